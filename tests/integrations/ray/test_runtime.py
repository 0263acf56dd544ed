"""draft_align.integrations.ray.runtime without a cluster: Ray missing and no cluster reachable are one line
each (the CLI's ``error: ...``), and importing draft_align's Ray modules starts nothing."""

from __future__ import annotations

import socket
import sys
import time

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

RECIPE = "recipes/smollm2_cotrain.yaml"


def test_ray_missing_is_one_line_naming_the_extra(monkeypatch, caplog):
    from draft_align.cli import main
    from draft_align.integrations.ray.runtime import RayUnavailableError, import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayUnavailableError, match=r"pip install 'draft-align\[ray\]'"):
        import_ray()
    assert main(["ray", "status", RECIPE]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0] and "draft-align[ray]" in errors[0]


def test_no_cluster_reachable_is_one_line(caplog):
    from draft_align.cli import main
    from draft_align.integrations.ray.runtime import RayConnectError, connect

    assert not ray.is_initialized()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RayConnectError, match="no Ray cluster reachable") as e:
        connect(f"127.0.0.1:{port}", "da-test")
    assert "\n" not in str(e.value) and not ray.is_initialized()
    assert main(["ray", "status", RECIPE, f"ray.address=127.0.0.1:{port}"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "no Ray cluster reachable" in errors[0]
    print(f"connect refused in {time.monotonic() - t0:.1f} s")


def test_a_cluster_refusing_authentication_is_not_called_unreachable(monkeypatch):
    """Issue 38 row 8: a token-auth cluster that refuses this client is reachable; the one line says so and what
    to set, instead of "no Ray cluster reachable"."""
    import types

    from draft_align.integrations.ray import runtime

    class FakeRay(types.SimpleNamespace):
        exceptions = types.SimpleNamespace()  # a Ray without an AuthenticationError type: judged by the words

        def is_initialized(self) -> bool:
            return False

        def init(self, **kw):
            raise RuntimeError(
                "Failed to connect to GCS: UNAUTHENTICATED: Authentication token is missing\nmore"
            )

    with socket.socket() as s:  # a port that listens: the cluster is reachable
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        monkeypatch.setattr(runtime, "import_ray", lambda: FakeRay())
        with pytest.raises(runtime.RayConnectError) as e:
            runtime.connect(f"127.0.0.1:{s.getsockname()[1]}", "draft_align")
    msg = str(e.value)
    assert "\n" not in msg and "reachable but refused this client's authentication" in msg
    assert "RAY_AUTH_MODE=token" in msg and "no Ray cluster reachable" not in msg


def test_a_bare_connect_failure_on_a_port_that_answers_names_token_auth(monkeypatch):
    """What Ray 2.60 really raises for a token-auth cluster and a client without the token (checked against one):
    a ConnectionError "Failed to connect to Ray cluster at …", the reason only in its C++ log. The port answers,
    so the line must not say "no Ray cluster reachable"."""
    import types

    from draft_align.integrations.ray import runtime

    class FakeRay(types.SimpleNamespace):
        exceptions = types.SimpleNamespace()

        def is_initialized(self) -> bool:
            return False

        def init(self, **kw):
            raise ConnectionError(f"Failed to connect to Ray cluster at {kw['address']}.")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        address = f"127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setattr(runtime, "import_ray", lambda: FakeRay())
        with pytest.raises(runtime.RayConnectError) as e:
            runtime.connect(address, "draft_align")
    msg = str(e.value)
    assert "\n" not in msg and "answers on its port but this client could not join" in msg
    assert "RAY_AUTH_MODE=token" in msg and "no Ray cluster reachable" not in msg


def test_importing_the_ray_modules_starts_no_cluster():
    import draft_align.integrations.ray.client  # noqa: F401
    import draft_align.integrations.ray.gang  # noqa: F401
    import draft_align.integrations.ray.host  # noqa: F401

    assert not ray.is_initialized()


def test_the_registry_refuses_publish_reports_that_are_not_the_runs(tmp_path, tiny_run):
    """A job on the cluster could pin the registry's newest version at 2^63 − 1, so that genuine publishes were
    never forwarded.  A report is kept only when it is the run's, newer by at most 2^20, and names the run's own
    folder of that version with that sha256."""
    import json
    import shutil

    from draft_align.integrations.ray.registry import DraftRegistry
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import resolve_draft_dir, version_dir
    from draft_align.wire.messages import DraftPublished

    run = tmp_path / "run"
    start = resolve_draft_dir(tiny_run.run_dir)
    for v in (1, 2):
        shutil.copytree(start, version_dir(run, v))
        m = json.loads((version_dir(run, v) / "manifest.json").read_text())
        m["draft_version"] = v
        (version_dir(run, v) / "manifest.json").write_text(json.dumps(m))
    reg = DraftRegistry(str(run), "run")  # no `latest`: it holds nothing yet

    def report(v, *, run_id="run", sha=None, path=None):
        folder = version_dir(run, v)
        sha = sha or read_manifest(folder, verify=False)["files"]["model.safetensors"]["sha256"]
        return DraftPublished(
            run_id=run_id, draft_version=v, policy_version=v, path=str(path or folder), sha256=sha
        )

    pin = DraftPublished(run_id="run", draft_version=2**63 - 1, policy_version=0, path="/x", sha256="0" * 64)
    for bogus in (
        pin,
        report(1, run_id="other"),
        report(1, sha="1" * 64),
        report(1, path=version_dir(run, 2)),
    ):
        reg.published(bogus)
    assert reg.newest() is None and reg.refused == 4
    reg.published(report(1))
    reg.published(report(2))
    assert reg.newest().draft_version == 2 and reg.info()["refused_reports"] == 4
