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


def test_importing_the_ray_modules_starts_no_cluster():
    import draft_align.integrations.ray.client  # noqa: F401
    import draft_align.integrations.ray.gang  # noqa: F401
    import draft_align.integrations.ray.host  # noqa: F401

    assert not ray.is_initialized()
