"""draft_align.sidecar.ranked, the multi-rank loop (``ranked_step``): a 2-rank sidecar on CPU (gloo) trains to the same
weights as one process, survives ``kill -9`` of a rank (the other stops with a clear error, a restarted job
resumes and keeps publishing), and refuses a misconfigured world.

Ranks run as subprocesses (this file's ``__main__`` for the weight comparison, the CLI otherwise) with the
torchrun environment (RANK, WORLD_SIZE, MASTER_*); one test launches through torchrun itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draft_align.config import CotrainRecipe, load_recipe

SEQ_LEN = 24
PROMPT_LEN = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


REPO = Path(__file__).resolve().parents[2]


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    # this file runs as a script (sys.path[0] = its folder): import the package of this checkout
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _sequences(n: int, sc_hidden: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` synthetic tapped sequences of one length and one prompt/response layout (so every subset of
    equal size holds the same number of target positions per TTT step)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        out.append(
            {
                "input_ids": torch.randint(3, vocab, (SEQ_LEN,), generator=g),
                "loss_mask": torch.arange(SEQ_LEN) >= PROMPT_LEN,
                "aux_hidden": torch.randn(SEQ_LEN, 3 * sc_hidden, generator=g),
                "final_hidden": torch.randn(SEQ_LEN, sc_hidden, generator=g),
            }
        )
    return out


def _tap_batch(
    run: str,
    seqs: list[dict[str, torch.Tensor]],
    aux: tuple[int, ...],
    hidden: int,
    vocab: int,
    step: int,
    version: int,
    batch_id: int,
):
    from draft_align.wire.messages import BatchHeader
    from draft_align.wire.packing import pack_sequences

    return pack_sequences(
        seqs,
        BatchHeader(
            run_id=run,
            policy_version=version,
            source_rank=0,
            batch_id=batch_id,
            step=step,
            aux_layer_ids=aux,
            hidden_size=hidden,
            vocab_size=vocab,
            final_norm="post",
            temperature=1.0,
        ),
    )


def _head_sync(run: str, draft, hidden: int, vocab: int, version: int):
    from draft_align.wire.messages import HeadSync

    return HeadSync(
        run_id=run,
        policy_version=version,
        hidden_size=hidden,
        vocab_size=vocab,
        norm_eps=1e-5,
        norm_weight=torch.ones(hidden),
        draft_to_target=draft.draft_to_target.cpu(),
        rows=draft.lm_head.weight.detach().bfloat16(),
    )


# ---------------------------------------------------------------------------------------- same weights
N_TRAIN = 8  # records trained on (all of them in every step); 2 ranks hold 4 each
N_HOLD = 2
STEPS = 3


def _join(recipe: CotrainRecipe, start: Path):
    """The rank group as ``run_sidecar`` joins it."""
    from draft_align.sidecar.launch import world_config
    from draft_align.train.parallel import join_ranks

    sc = recipe.sidecar
    return join_ranks(
        ranks=sc.ranks,
        device=recipe.device,
        timeout_s=sc.collective_timeout_s,
        config=world_config(recipe, start),
    )


def _fill(sc, part: int, parts: int) -> None:
    """Buffer this rank's share of the fixed records, in float32 (bf16 autocast is off: its rounding would make
    AdamW's near-zero-gradient updates differ with the reduction order); rank 0 (which gates) also gets the
    records to hold out, the other ranks hold none out."""
    from draft_align.train.records import Record, TappedRecord

    train = _sequences(N_TRAIN, sc.hidden, sc.vocab, seed=1)
    share = N_TRAIN // parts
    hold = _sequences(N_HOLD, sc.hidden, sc.vocab, seed=2) if part == 0 else []
    buffered = sc.state.buffered_tokens  # a resumed sidecar's count goes on from its checkpoint
    for s in train[part * share : (part + 1) * share] + hold:
        rec = Record(
            input_ids=s["input_ids"], loss_mask=s["loss_mask"], aux=s["aux_hidden"], final=s["final_hidden"]
        )
        assert sc.ingest.buffer_record(TappedRecord(record=rec, policy_version=0, step=0))
    assert sc.state.buffered_tokens - buffered == SEQ_LEN * (share + len(hold))
    sc.on_head(_head_sync(sc.recipe.run, sc.frozen, sc.hidden, sc.vocab, 0))
    assert sc.has_head
    assert len(sc.ingest.buffer.trainable()) == share and len(sc.ingest.buffer.holdout()) == len(hold)


def _same_weights_overrides(
    tiny_run, out: Path, run: str, ranks: int, parallel: str = "ddp", **extra: object
) -> list[str]:
    return tiny_run.cotrain_overrides(
        out,
        run=run,
        **{
            "sidecar.ranks": ranks,
            "sidecar.buffer.holdout_records": N_HOLD,
            "sidecar.train.objective.autocast_bf16": "false",
            "sidecar.buffer.holdout_every": 1,
            "sidecar.buffer.fresh_first": "false",
            "sidecar.publish.on_new_version": "false",
            "sidecar.buffer.max_replay_ratio": 1000.0,
            "sidecar.publish.every_s": 604800,
            "sidecar.train.checkpoint_every_s": 604800,
            "sidecar.monitor.prometheus_port": "null",
            "sidecar.train.objective.warmup_steps": 0,
            "sidecar.train.objective.lr": 3e-3,
            "sidecar.parallel": parallel,
            **extra,
        },
    )


def _record_grad_norms(sc) -> list[float]:
    """The pre-clip gradient norm of each of ``sc``'s optimizer steps, appended as they are taken."""
    norms: list[float] = []
    step = sc.trainer.train_step

    def recorded(batch):
        out = step(batch)
        norms.append(out["grad_norm"])
        return out

    sc.trainer.train_step = recorded
    return norms


def _local(v: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (DTensor), or the tensor itself."""
    return v.to_local() if hasattr(v, "to_local") else v


def _rank_worker(overrides: list[str]) -> None:
    """One rank of the weight comparison: join, ingest its half, take STEPS ranked steps, rank 0 publishes
    (and writes the steps' gradient norms beside the run).  Then rank 1 alone draws a batch whose loss is not
    finite: both ranks skip that step (no hang, no update)."""
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar
    from draft_align.sidecar.ranked import ranked_step
    from draft_align.train.records import Record, TappedRecord
    from draft_align.train.replay import ReplayBuffer

    torch.set_num_threads(1)
    recipe = load_recipe(None, overrides, CotrainRecipe)
    start = starting_draft(recipe)
    with _join(recipe, start) as ranks:
        assert ranks is not None
        sc = Sidecar(recipe, start, ranks=ranks).setup()
        if recipe.sidecar.parallel == "fsdp2":  # each rank holds about half of every trainable parameter
            trained = [p for p in sc.trainer.draft.parameters() if p.requires_grad]
            assert trained and all(p.to_local().numel() <= (p.numel() + 1) // 2 for p in trained)
            assert {id(p) for g in sc.trainer.optimizer.param_groups for p in g["params"]} == {
                id(p) for p in trained
            }
        norms = _record_grad_norms(sc)
        _fill(sc, ranks.rank, ranks.world_size)
        for _ in range(STEPS):
            assert ranked_step(sc)
        assert sc.state.train_steps == STEPS, sc.state
        sc.sync_full()  # fsdp2: gathers onto rank 0 (every rank calls it); ddp: nothing to do
        if ranks.is_lead:
            assert sc.maybe_publish(force=True)
            (recipe.run_dir / "grad_norms.json").write_text(json.dumps(norms))
        before = {k: _local(v).clone() for k, v in sc.trainer.draft.state_dict().items()}
        if ranks.rank == 1:  # finite but huge states overflow inside the draft
            sc.ingest.buffer = ReplayBuffer(4000, 2.0, 0, 0)
            rec = Record(
                input_ids=torch.randint(3, sc.vocab, (20,)),
                loss_mask=torch.arange(20) >= 5,
                aux=torch.full((20, 3 * sc.hidden), 3e38),
                final=torch.randn(20, sc.hidden),
            )
            sc.ingest.buffer.add(TappedRecord(record=rec, policy_version=0, step=0))
        assert ranked_step(sc)
        assert (sc.state.nonfinite_steps, sc.state.train_steps) == (1, STEPS), sc.state
        for k, v in sc.trainer.draft.state_dict().items():
            assert torch.equal(_local(v), before[k]), k
        sc.close()


def _tensors(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(published v0001 weights (bf16), the trainer's float32 weights checkpointed with that publish)."""
    from safetensors.torch import load_file

    trainer = load_file(str(run_dir / "sidecar" / "trainer" / "state.safetensors"))
    return (
        load_file(str(run_dir / "drafts" / "v0001" / "model.safetensors")),
        {k[len("draft.") :]: v for k, v in trainer.items() if k.startswith("draft.")},
    )


def _run_ranks(mode: str, overrides: list[str], world: int = 2) -> list[subprocess.Popen]:
    port = _free_port()
    return [
        subprocess.Popen(
            [sys.executable, __file__, mode, json.dumps(overrides)],
            env=_rank_env(r, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def _wait_ok(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]


def _two_ranks_match_one_process(tiny_run, tmp_path: Path, parallel: str, **extra: object) -> None:
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar

    procs = _run_ranks(
        "rank-worker", _same_weights_overrides(tiny_run, tmp_path, "two", 2, parallel, **extra)
    )
    one = load_recipe(None, _same_weights_overrides(tiny_run, tmp_path, "one", 1, **extra), CotrainRecipe)
    sc = Sidecar(one, starting_draft(one)).setup()
    norms = _record_grad_norms(sc)
    _fill(sc, 0, 1)
    for _ in range(STEPS):
        assert sc.train_one()
    assert sc.maybe_publish(force=True)
    sc.close()
    _wait_ok(procs)
    # the global gradient norm (clipping's denominator): over DTensor shards under fsdp2
    norms2 = json.loads((tmp_path / "two" / "grad_norms.json").read_text())
    assert len(norms) == len(norms2) == STEPS and norms[0] > one.sidecar.train.objective.grad_clip, (
        norms,
        norms2,
    )
    assert norms2 == pytest.approx(norms, rel=1e-4), (norms, norms2)
    (pub1, w1), (pub2, w2) = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    start = sc.frozen.state_dict()
    assert w1.keys() == w2.keys() and pub1.keys() == pub2.keys()
    moved = err = 0.0
    for k in w1:
        # AdamW divides by √v: float reduction-order noise in tiny gradients shows up as ~1e-5 in the weights
        assert torch.allclose(w1[k], w2[k], rtol=0, atol=5e-5), (k, (w1[k] - w2[k]).abs().max())
        if w1[k].is_floating_point():
            moved += float((w1[k] - start[k].float()).pow(2).sum())
            err += float((w1[k] - w2[k]).pow(2).sum())
    # training moved the weights (lr 3e-3, 3 steps) and both runs moved them the same way: a rank that
    # trained on its half alone would differ by O(1) of the update
    assert moved**0.5 > 0.05 and (err / moved) ** 0.5 < 1e-3, (moved**0.5, (err / moved) ** 0.5)
    for k in pub1:  # the published bf16 copies: equal up to one bf16 rounding step
        assert torch.allclose(pub1[k].float(), pub2[k].float(), rtol=2**-7, atol=1e-6), k


def test_two_ranks_publish_the_weights_of_one_process(tiny_run, tiny_env, tmp_path):
    """2 ranks × 4 records with DDP-averaged gradients = 1 process × all 8 records (equal target counts per
    rank), for STEPS AdamW steps, up to float reduction order; and different from not training."""
    _two_ranks_match_one_process(tiny_run, tmp_path, "ddp")


def test_fsdp2_ranks_publish_the_weights_of_one_process(tiny_run, tiny_env, tmp_path):
    """The same with the draft's parameters and AdamW moments sharded over the 2 ranks (FSDP2): gradients
    reduce-scattered, clipped by the global norm, the full weights gathered onto rank 0 to gate and publish."""
    _two_ranks_match_one_process(tiny_run, tmp_path, "fsdp2")


def _resume_worker(overrides: list[str]) -> None:
    """One rank of a job restarted over an fsdp2 checkpoint: every rank loads rank 0's full checkpoint into its
    shards (gathered back, it equals the file), then the ranks train on and rank 0 publishes the next version."""
    from safetensors.torch import load_file

    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar
    from draft_align.sidecar.ranked import ranked_step

    torch.set_num_threads(1)
    recipe = load_recipe(None, overrides, CotrainRecipe)
    start = starting_draft(recipe)
    saved = load_file(str(recipe.run_dir / "sidecar" / "trainer" / "state.safetensors"))
    with _join(recipe, start) as ranks:
        assert ranks is not None
        sc = Sidecar(recipe, start, ranks=ranks).setup()
        assert (sc.state.restarts, sc.state.train_steps, sc.state.published_version) == (1, STEPS, 1), (
            sc.state
        )
        assert sc.trainer.progress.step == STEPS and sc.trainer.scheduler.last_epoch == STEPS
        sc.sync_full()
        if ranks.is_lead:
            assert sc.full_state is not None
            draft, opt = sc.full_state
            assert {f"draft.{k}" for k in draft} == {k for k in saved if k.startswith("draft.")}
            for k, v in draft.items():
                assert torch.equal(v, saved[f"draft.{k}"]), k
            n_opt = 0
            for i, st in opt["state"].items():
                for name, v in st.items():
                    assert torch.equal(torch.as_tensor(v), saved[f"opt.{i}.{name}"]), (i, name)
                    n_opt += 1
            assert n_opt == sum(k.startswith("opt.") for k in saved) > 0
        _fill(sc, ranks.rank, ranks.world_size)  # the replay buffer is not checkpointed
        for _ in range(2):
            assert ranked_step(sc)
        assert sc.state.train_steps == STEPS + 2 and sc.trainer.progress.step == STEPS + 2, sc.state
        sc.sync_full()
        if ranks.is_lead:
            assert sc.maybe_publish(force=True) and sc.state.published_version == 2
        sc.close()


def test_fsdp2_checkpoint_resumes(tiny_run, tiny_env, tmp_path):
    """A checkpoint written under fsdp2 (at the publish, from the gathered full state) restarts a 2-rank job:
    the trainer's weights and AdamW moments come back exactly, training continues, v0002 is published."""
    overrides = _same_weights_overrides(tiny_run, tmp_path, "two", 2, "fsdp2")
    _wait_ok(_run_ranks("rank-worker", overrides))
    assert _versions(tmp_path / "two") == [1]
    _wait_ok(_run_ranks("resume-worker", overrides))
    assert _versions(tmp_path / "two") == [1, 2]
    state = json.loads((tmp_path / "two" / "sidecar" / "state.json").read_text())
    assert (state["train_steps"], state["restarts"], state["published_version"]) == (STEPS + 2, 1, 2), state


# ---------------------------------------------------------------------------------------- kill -9 / resume
class SyntheticFeeder:
    """The policy side: one TapSender connected to every rank's endpoint; each call sends a HeadSync, one
    TapBatch of 8 sequences and a StepReport."""

    def __init__(self, recipe: CotrainRecipe, start: Path) -> None:
        from draft_align.publish import load_draft
        from draft_align.wire import channel

        self.recipe = recipe
        self.draft, _ = load_draft(start)
        cfg = self.draft.cfg
        self.aux, self.hidden, self.vocab = tuple(cfg.aux_layer_ids), cfg.target_hidden_size, cfg.vocab_size
        self.key = channel.resolve_key(None, recipe.run_dir, create=True)
        eps = channel.tap_endpoints(channel.default_endpoint(recipe.run_dir, "tap"), recipe.sidecar.ranks)
        self.sender = channel.TapSender(eps, self.key, send_timeout_s=0.2)
        self.step = 0
        self._last = 0.0

    def feed(self) -> None:
        """One RL step's messages, at most every 0.3 s (the test's CPUs are the sidecar's too)."""
        from draft_align.wire.messages import StepReport

        if time.monotonic() - self._last < 0.3:
            return
        self._last = time.monotonic()
        version = self.step // 2
        run = self.recipe.run
        for _ in range(2):  # round-robin: each rank gets a batch
            self.sender.offer(_head_sync(run, self.draft, self.hidden, self.vocab, version))
            seqs = _sequences(8, self.hidden, self.vocab, seed=100 + self.step)
            self.sender.offer(
                _tap_batch(run, seqs, self.aux, self.hidden, self.vocab, self.step, version, self.step)
            )
        self.sender.offer(
            StepReport(run_id=run, step=self.step, policy_version=version, metrics={"reward_mean": 1.0})
        )
        self.step += 1

    def finish(self) -> None:
        from draft_align.wire.messages import StepReport

        for _ in range(2):
            self.sender.offer(
                StepReport(run_id=self.recipe.run, step=self.step, policy_version=0, metrics={"final": 1.0})
            )

    def close(self) -> None:
        self.sender.close()


def _versions(run_dir: Path) -> list[int]:
    from draft_align.publish.folder import CorruptCheckpointError, read_manifest

    out = []
    for d in sorted((run_dir / "drafts").glob("v*")):
        try:
            out.append(read_manifest(d, verify=True)["draft_version"])
        except CorruptCheckpointError:
            if d.exists():
                raise  # half-written: never allowed; a folder retention deleted meanwhile is fine
    return out or [0]


def _cli(resolved: Path, start: Path, *extra: str) -> list[str]:
    return ["-m", "draft_align", "sidecar", str(resolved), "--draft", str(start), "--exit-when-done", *extra]


@pytest.mark.slow  # ~70 s on 2 shared CPU cores: four sidecar processes start (two through torchrun)
def test_kill9_of_a_rank_is_reported_and_a_restarted_job_resumes(tiny_run, tiny_env, tmp_path, until):
    """Rank 1 is killed mid-run: rank 0 exits non-zero within seconds naming the cause (no hang); every visible
    draft is complete; the job restarted under torchrun resumes from rank 0's checkpoint, publishes higher
    versions and both ranks exit 0 after the final StepReport."""
    from draft_align.cotrain import write_resolved
    from draft_align.sidecar.launch import starting_draft

    recipe = load_recipe(
        None,
        tiny_run.cotrain_overrides(
            tmp_path,
            run="ddp",
            **{
                "sidecar.ranks": 2,
                "sidecar.collective_timeout_s": 30.0,
                "sidecar.monitor.prometheus_port": "null",
                "sidecar.publish.every_s": 0.5,
            },
        ),
        CotrainRecipe,
    )
    resolved = write_resolved(recipe)
    start = starting_draft(recipe)
    feeder = SyntheticFeeder(recipe, start)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *_cli(resolved, start)],
            env=_rank_env(r, 2, port),
            stdout=open(logs[r], "wb"),
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]  # noqa: SIM115
    launcher = None
    try:
        assert until(
            lambda: len(list((recipe.run_dir / "drafts").glob("v*"))) >= 1, 90, every=feeder.feed, poll_s=0.1
        ), logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        rc0 = procs[0].wait(timeout=60)
        waited = time.monotonic() - t0
        assert procs[1].wait(timeout=10) == -signal.SIGKILL
        text0 = logs[0].read_text()
        assert rc0 == 2 and "another sidecar rank died" in text0, text0[-3000:]
        assert waited < 30, waited
        before = _versions(recipe.run_dir)  # consecutive; retention keeps the newest keep_versions
        assert (
            before == list(range(before[0], before[0] + len(before)))
            and len(before) <= recipe.sidecar.publish.keep_versions
        )
        steps_before = json.loads((recipe.run_dir / "sidecar" / "state.json").read_text())["train_steps"]
        assert steps_before >= 1

        # restart through torchrun itself (what --max-restarts would do)
        log = tmp_path / "torchrun.log"
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": _rank_env(0, 2, port)["PYTHONPATH"],
        }  # this checkout's package, as for the ranks
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                *_cli(resolved, start)[1:],
            ],
            env=env,
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True,
        )
        assert until(
            lambda: max(_versions(recipe.run_dir)) > before[-1], 90, every=feeder.feed, poll_s=0.1
        ), log.read_text()[-4000:]
        feeder.finish()
        assert launcher.wait(timeout=60) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert text.count(f"resumed sidecar at train step {steps_before} (restart 1)") == 2, text[
            -4000:
        ]  # both ranks
        state = json.loads((recipe.run_dir / "sidecar" / "state.json").read_text())
        assert state["restarts"] >= 1 and state["train_steps"] > steps_before
        after = _versions(recipe.run_dir)
        assert after == list(range(after[0], after[0] + len(after))) and after[-1] > before[-1]
        # every rank applies every StepReport, only rank 0 writes its row: no step appears twice
        rows = [
            json.loads(x) for x in (recipe.run_dir / "sidecar" / "monitor.jsonl").read_text().splitlines()
        ]
        steps = [r["step"] for r in rows]
        assert steps and len(steps) == len(set(steps))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if launcher is not None and launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        feeder.close()


# ---------------------------------------------------------------------------------------- bad world
def test_ranks_that_disagree_on_the_recipe_refuse_to_start(tiny_run, tiny_env, tmp_path):
    from draft_align.cotrain import write_resolved
    from draft_align.sidecar.launch import starting_draft

    port = _free_port()
    procs = []
    for r, lr in enumerate(("1e-3", "2e-3")):
        recipe = load_recipe(
            None,
            tiny_run.cotrain_overrides(
                tmp_path / f"r{r}",
                run="bad",
                **{
                    "sidecar.ranks": 2,
                    "sidecar.train.objective.lr": lr,
                    "sidecar.collective_timeout_s": 30.0,
                },
            ),
            CotrainRecipe,
        )
        resolved = write_resolved(recipe)
        procs.append(
            subprocess.Popen(
                [sys.executable, *_cli(resolved, starting_draft(recipe))],
                env=_rank_env(r, 2, port),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=90)
        assert p.returncode == 2, out[-2000:]
        assert (
            "disagree on the recipe" in out
            and "sidecar.train.objective.lr: rank 0 0.001, rank 1 0.002" in out
        ), out[-2000:]
    assert not (tmp_path / "r0" / "bad" / "sidecar" / "ready.json").exists()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "rank-worker":
    _rank_worker(json.loads(sys.argv[2]))
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "resume-worker":
    _resume_worker(json.loads(sys.argv[2]))
