"""The co-training sidecar: receive → validate → replay buffer → TTT training → gate → versioned publish → notify.

- :mod:`~draft_align.sidecar.layout`: its folder, files and socket names in a run folder;
- :mod:`~draft_align.sidecar.state`: :class:`SidecarState`, the progress checkpointed beside the trainer;
- :mod:`~draft_align.sidecar.ingest`: tapped messages → validated records → the replay buffer;
- :mod:`~draft_align.sidecar.gate`: the paired publish gate and the versioned publish;
- :mod:`~draft_align.sidecar.build`: its parts built from the recipe (target side, starting drafts, gate, trainer,
  ingest, sockets, sinks);
- :mod:`~draft_align.sidecar.loop`: :class:`Sidecar` (setup order, hooks) and its single-process loop;
- :mod:`~draft_align.sidecar.ranked`: the multi-rank loop and the gathered FSDP2 copy;
- :mod:`~draft_align.sidecar.trigger`: when to train (always, or on drift);
- :mod:`~draft_align.sidecar.resume`: what a restarting sidecar can trust (the newest version and checkpoint that verify);
- :mod:`~draft_align.sidecar.lock`: one sidecar per run folder (an exclusive ``flock`` naming the holder's pid);
- :mod:`~draft_align.sidecar.launch`: the starting draft and the process entry point (``draft-align sidecar``);
- :mod:`~draft_align.sidecar.process`: the sidecar as a child process of an RL job (start, wait until bound, stop).
"""
