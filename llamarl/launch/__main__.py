"""`python -m llamarl.launch RECIPE.yaml [key=value ...]`

Under torchrun or srun every rank runs this: parse and validate the recipe and the rank layout
(cheap imports only), set up the job store and watchdog, then become a trainer or a generator.
Run directly (no launcher environment), it runs torchrun itself on this machine with as many
ranks as the recipe's layout needs.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback

from llamarl.config import load_config
from llamarl.runtime.cores import release_cores_promptly
from llamarl.runtime.dist_env import from_environ
from llamarl.runtime.layout import compute_layout
from llamarl.runtime.onednn import cap_primitive_cache
from llamarl.runtime.watchdog import say

SILENT_RANK_GRACE_S = 3.0

USAGE = ("usage: torchrun --nproc-per-node N -m llamarl.launch RECIPE.yaml [key=value ...]\n"
         "   or: python -m llamarl.launch RECIPE.yaml [key=value ...]   (starts torchrun itself)\n"
         "   or: python -m llamarl.launch --ranks RECIPE.yaml [key=value ...]  (print N)\n"
         "   or: python -m llamarl.launch --join RUN_DIR [key=value ...]  (replace a lost "
         "engine of a running job)")


def self_launch(n_ranks: int, argv: list[str]) -> int:
    """Run a single-node torchrun of `n_ranks` ranks from this process; its exit status.

    torchrun's own `main` ends a failed job with a ChildFailedError traceback and a 40-line
    summary of every rank's exit, after the line in which the failing rank said why (every
    llamarl rank ends with one `llamarl: ...` line): its `run` is called instead, and a
    failure ends quietly, with a line of its own only for a rank that died without saying why
    (a signal). OMP_NUM_THREADS=1 is set as torchrun sets it (the ranks choose their threads,
    runtime/cores.py), which spares its banner."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = ["--standalone", f"--nproc-per-node={n_ranks}", "-m", "llamarl.launch", *argv]
    print(f"llamarl: launching {n_ranks} local ranks: torchrun {' '.join(args)}",
          file=sys.stderr, flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the agent's notes on stopping the other ranks once one failed ("Sending process ...
    # closing signal SIGTERM", "failed (exitcode: 1) local_rank: ..."): the ranks say why
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(args))
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        # A rank that exits with a status wrote its line (a killed one's peers name it); the
        # ranks torchrun stops after the first failure die of its SIGTERM. Only when every
        # rank was killed (none could say why) is the first one named here.
        if all(f.exitcode < 0 for _, f in failures):
            rank, failure = failures[0]
            say(f"llamarl: rank {rank} was killed ({failure.signal_name()}) and the job "
                "stopped")
        return 1
    except SignalException as e:  # Ctrl-C or SIGTERM to this launcher: the ranks are stopped
        return 128 + int(e.sigval)
    return 0


def replacement_not_back(rt) -> bool:
    """Whether this replacement engine (launch/join.py) has not rejoined the roster yet (read
    from the store while it is there; `rt.back` remembers it for when it is gone)."""
    from llamarl.runtime.roster import Roster

    if not rt.back:
        try:
            rt.back = rt.role.index not in Roster(rt.store, rt.layout.engines).read().lost
        except Exception:  # noqa: BLE001 - the store is gone: as last read
            pass
    return not rt.back


def leave_when_stopped(rt) -> None:
    """A replacement started by hand (`--join`, not by a supervisor under torchrun) that is
    stopped (Ctrl-C, SIGTERM) leaves the job, which goes on without its engine as after a
    loss, instead of failing it."""
    import signal

    def stop(signum, frame) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        rt.watchdog.leave(f"stopped ({name})",
                          "this replacement leaves the job, which goes on without its engine")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    if rt.role.tp_rank == 0:
        print(f"llamarl: {rt.watchdog.role_name(rt.env.rank)}: Ctrl-C or SIGTERM stops this "
              "replacement alone (the job goes on without its engine)", file=sys.stderr,
              flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    print_ranks, joining = argv[0] == "--ranks", argv[0] == "--join"
    if print_ranks or joining:
        argv = argv[1:]
        if not argv:
            print(USAGE)
            return 2
    recipe, overrides = argv[0], argv[1:]
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr (the rank goes on): what
    # a hung rank waits in (docs/operations.md)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    env, incarnation, tp_ranks = None, "", []
    release_cores_promptly()  # before torch is imported: the OpenMP runtime reads it once
    cap_primitive_cache()  # before the first bfloat16 matmul: oneDNN reads it once
    try:
        if joining:
            from llamarl.launch.join import plan_join, spawn_tp_ranks
            cfg, layout, env, incarnation = plan_join(recipe, overrides)
            print(f"llamarl: joining the job of {recipe} as {layout.role_of(env.rank).name} "
                  f"(rank {env.rank}), replacing the lost engine", file=sys.stderr, flush=True)
            if layout.tp > 1 and layout.role_of(env.rank).tp_rank == 0:  # its other tp ranks
                tp_ranks = spawn_tp_ranks(layout, env, incarnation, ["--join", *argv])
        elif print_ranks:
            cfg = load_config(recipe, overrides)
            print(cfg.trainer.ranks + cfg.generator.engines * cfg.generator.tp)
            return 0
        else:
            cfg = load_config(recipe, overrides)
            env = from_environ()
            needed = cfg.trainer.ranks + cfg.generator.engines * cfg.generator.tp
            if env is None:
                return self_launch(needed, argv)
            layout = compute_layout(env.world_size, env.local_world_size, cfg.trainer.ranks,
                                    cfg.generator.engines, cfg.generator.tp)
    except ValueError as e:
        if env is None or env.local_rank == 0:
            say(f"llamarl: error: {e}")
        else:
            # Every rank finds the same error; local rank 0 alone says it. torchrun kills the
            # survivors within its 0.1 s monitor interval once any rank exits, so the silent
            # ranks linger long enough for rank 0's line to get out first.
            time.sleep(SILENT_RANK_GRACE_S)
        return 2

    if env.local_rank == 0 and not joining:  # a half precision this host runs slowly
        from llamarl.models.precision import slow_dtype_warning
        if (warning := slow_dtype_warning(cfg.model.dtype)) is not None:
            say(warning)

    # Each rank's GPU(s), before anything touches CUDA (runtime/gpus.py: vLLM would put every
    # engine on cuda:0)
    from llamarl.runtime.gpus import apply_placement, check_placed
    try:
        placement = apply_placement(layout, env.rank, env.local_rank)
        if placement is not None:  # the mask must have taken effect (CUDA not yet started)
            import torch
            check_placed(placement, env.rank, layout.node_of(env.rank),
                         torch.cuda.device_count())
    except ValueError as e:  # too few GPUs: every rank of the node finds it, local rank 0 says
        if env.local_rank == 0:
            say(f"llamarl: error: {e}")
        else:
            time.sleep(SILENT_RANK_GRACE_S)  # (as above)
        return 2
    except RuntimeError as e:  # this rank's mask did not take effect
        say(f"llamarl: error: {e}")
        return 2
    if placement is None:  # a CPU rank
        from llamarl.runtime.allocator import keep_freed_memory
        keep_freed_memory()  # large tensors reuse freed memory, not fresh pages (allocator.py)

    if not joining:
        from llamarl.launch.supervisor import supervise, wants_supervisor
        if wants_supervisor(cfg, layout, env):  # an engine the job can lose, under torchrun
            return supervise(argv, cfg, layout, env)

    from llamarl.buffer.shm import sweep_run  # heavy imports start here
    from llamarl.generator.log_hygiene import quiet_third_party
    from llamarl.parallel.groups import default_backend
    from llamarl.parallel.plan import comm_plan
    from llamarl.runtime.setup import SetupError, setup

    try:
        rt = setup(cfg, layout, env, joining=incarnation,
                   survives_engine_loss=lambda device: comm_plan(
                       cfg, layout, default_backend(device)).survives_engine_loss,
                   cleanups=(sweep_run,),
                   before_roles=quiet_third_party)
    except SetupError as e:  # reported to the peers when a store was reached
        say(f"llamarl: rank {env.rank}: error: {e}")
        time.sleep(SILENT_RANK_GRACE_S)  # the peers read the report from the store first
        os._exit(1)  # a given-up store handshake may still hold a thread
    if rt.joining:  # until it is back (generator/loop.py: rejoin), a lost store ends it well
        rt.watchdog.replacement_not_back = lambda: replacement_not_back(rt)
        from llamarl.launch.join import ENGINE_ENV
        if not os.environ.get(ENGINE_ENV):  # started by hand, not by a supervisor
            leave_when_stopped(rt)
    if tp_ranks:  # a replacement's other tp ranks: watched from their start
        rt.watchdog.children = list(zip(layout.engine_global_ranks(rt.role.index)[1:],
                                        tp_ranks))
    try:
        if rt.role.role == "trainer":
            from llamarl.trainer.loop import run_trainer
            run_trainer(rt)
        else:
            from llamarl.generator.loop import run_generator
            run_generator(rt)
        rt.watchdog.mark_done()
        rt.end_of_job()  # each node's shared memory swept once every rank is done
    except BaseException as e:  # noqa: BLE001 - report every failure to the peers, then exit
        if not isinstance(e, KeyboardInterrupt):
            rt.watchdog.leave_if_mate_lost()  # this rank's engine is lost, the job goes on
            if rt.joining and replacement_not_back(rt):  # the job goes on as it did
                rt.watchdog.leave(f"this replacement failed before it was back in the job "
                                  f"({type(e).__name__}: {e})")
        error = f"{type(e).__name__}: {e}"
        dead = rt.watchdog.dead_peer()  # a dead peer is the cause, not this rank's error
        if not isinstance(e, (KeyboardInterrupt, ValueError)) and dead is None:
            traceback.print_exc()
        message = f"{dead}; stopping ({error})" if dead else error
        rt.watchdog.report_failure(message)
        say(f"llamarl: {rt.watchdog.role_name(env.rank)}: {message}")
        rt.cleanup_shared_memory()
        rt.watchdog.linger_if_store_host()  # (srun: the peers read the report from its store)
        os._exit(1)
    rt.watchdog.stop()
    failed = [p.args for p in tp_ranks if p.wait() != 0]  # (a replacement's other tp ranks)
    sys.stdout.flush()
    sys.stderr.flush()
    if failed:
        os._exit(1)
    # vLLM's in-process engine leaves non-daemon threads behind; the work is done and flushed.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
