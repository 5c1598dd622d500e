"""A real single-node SLURM cluster on localhost, for tests (and laptops).

`LocalSlurm` drives `slurm/local/{install,start,stop}.sh`: slurmctld, slurmd and munge
(plus slurmdbd + MariaDB for `sacct` when `with_dbd`), all under one state directory, on
free ports, so that several clusters can coexist on one machine. Jobs run as the
invoking user (root) on this machine.

pytest fixtures (import them into a conftest.py, or list this module in `pytest_plugins`
of the root conftest):

    slurm_cluster   session scope: a started LocalSlurm, stopped at the end of the session.
                    Fails (never skips) with the reason when SLURM cannot be installed or
                    started.
    slurm_env       function scope: the same cluster, with SLURM_CONF and PATH set in
                    os.environ for the duration of the test, so that `sbatch`, `squeue`
                    and submitit's SlurmExecutor/AutoExecutor talk to it.

    def test_my_job(slurm_env, tmp_path):
        job_id = slurm_env.sbatch(["--wrap", "echo hi"], output=tmp_path / "out.txt")
        assert slurm_env.wait(job_id) == "COMPLETED"
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "slurm" / "local"
# The unix socket path of munge must stay under ~108 bytes.
MAX_STATE_DIR_LEN = 70
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


class SlurmStartError(RuntimeError):
    """The local cluster could not be installed or started; the message says why."""


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# The cluster's daemons take ports in 10000-19999: train.sbatch's rendezvous takes 20000 + job
# id % 12000 (slurm/train.sbatch rdzv_port), and the kernel hands out 32768 and above. A base
# of 20019 once put slurmctld, slurmd and slurmdbd on the rendezvous ports of jobs 19-21.
PORT_BASES = (10000, 20000 - 13)


def free_port_base(rng: random.Random | None = None) -> int:
    """A base port P with P, P+1, P+2 and P+13 free (slurmctld, slurmd, slurmdbd, MariaDB),
    all below the rendezvous ports of the cluster's jobs."""
    rng = rng or random.Random()
    for _ in range(200):
        base = rng.randrange(*PORT_BASES)
        if all(_port_free(base + k) for k in (0, 1, 2, 13)):
            return base
    low, high = PORT_BASES
    raise SlurmStartError(
        f"found no free ports for the local SLURM cluster in {low}-{high + 13 - 1}"
    )


class LocalSlurm:
    """One local cluster: `start()`, `stop()`, client helpers with the right environment."""

    def __init__(
        self,
        state_dir: str | Path | None = None,
        *,
        port_base: int | None = None,
        with_dbd: bool = True,
        cpus: int | None = None,
        timeout_s: float = 300,
    ):
        # A state directory made here is this object's to remove (stop() does, once the
        # cluster came up; after a failed start it stays, since the error points at its logs).
        if state_dir is not None and len(str(state_dir)) <= MAX_STATE_DIR_LEN:
            self.state_dir, self.owns_state_dir = Path(state_dir), False
        else:
            self.state_dir = Path(tempfile.mkdtemp(prefix="gpn-slurm-", dir="/tmp"))
            self.owns_state_dir = True
        self.start_failed = False
        self.port_base = port_base or free_port_base()
        self.with_dbd = with_dbd
        self.cpus = cpus
        self.timeout_s = timeout_s
        self.started = False

    # -- environment -----------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default os.environ) with SLURM_CONF pointing at this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        path = env.get("PATH", "")
        if "/usr/sbin" not in path.split(":"):
            env["PATH"] = f"{path}:/usr/sbin" if path else "/usr/sbin:/usr/bin:/bin"
        return env

    def _script_env(self) -> dict[str, str]:
        env = self.env()
        env.update(
            SLURM_LOCAL_DIR=str(self.state_dir),
            SLURM_LOCAL_PORTBASE=str(self.port_base),
            SLURM_LOCAL_WITH_DBD="1" if self.with_dbd else "0",
        )
        if self.cpus:
            env["SLURM_LOCAL_CPUS"] = str(self.cpus)
        return env

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> LocalSlurm:
        script = SCRIPTS / "start.sh"
        if not script.is_file():
            raise SlurmStartError(f"{script} not found; LocalSlurm needs a source checkout")
        try:
            proc = subprocess.run(
                ["bash", str(script)],
                env=self._script_env(),
                text=True,
                capture_output=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired as err:
            self.start_failed = True
            raise SlurmStartError(
                f"slurm/local/start.sh took over {self.timeout_s:.0f}s; logs in "
                f"{self.state_dir / 'log'}"
            ) from err
        self.started = True  # partially started daemons must still be stopped
        if proc.returncode != 0:
            self.start_failed = True
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise SlurmStartError(
                f"slurm/local/start.sh failed (exit {proc.returncode}); "
                f"logs in {self.state_dir / 'log'}:\n{tail}"
            )
        return self

    def _purge_on_stop(self, purge: bool) -> bool:
        return purge or (self.owns_state_dir and not self.start_failed)

    def stop(self, purge: bool = False) -> str:
        """Stop the daemons; `purge` also removes the state directory (always done for one
        this object made, unless its start failed)."""
        env = self._script_env()
        env["SLURM_LOCAL_PURGE"] = "1" if self._purge_on_stop(purge) else "0"
        proc = subprocess.run(
            ["bash", str(SCRIPTS / "stop.sh")], env=env, text=True, capture_output=True, timeout=120
        )
        self.started = False
        return proc.stdout + proc.stderr

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def daemon_pids(self) -> dict[str, int]:
        """Live daemons of this cluster, from its pid files."""
        out = {}
        for pidfile in sorted((self.state_dir / "run").glob("*.pid")):
            try:
                pid = int(pidfile.read_text().strip())
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except (OSError, ValueError):
                continue
            if comm == pidfile.stem:
                out[comm] = pid
        return out

    # -- clients ---------------------------------------------------------------------------
    def run(
        self, args: Sequence[str], check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run a SLURM client command (`["sinfo", "-h"]`) against this cluster."""
        proc = subprocess.run(
            list(args), env=self.env(), text=True, capture_output=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}"
            )
        return proc

    def sbatch(self, args: Sequence[str], output: str | Path | None = None) -> str:
        """Submit; returns the job id. `args` are sbatch arguments (e.g. a script path or
        ["--wrap", "cmd"]); `output` sets -o."""
        cmd = ["sbatch", "--parsable"]
        if output is not None:
            cmd += ["-o", str(output)]
        proc = self.run(cmd + list(args))
        return proc.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """State of the job's allocation: squeue while it is known there, then sacct (with
        accounting) or scontrol."""
        proc = self.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
        states = proc.stdout.split()
        if proc.returncode == 0 and states:
            return states[0]
        if self.with_dbd:
            proc = self.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"], check=False)
            states = proc.stdout.split()
            if states:
                return states[0].split()[0]
        proc = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        for word in proc.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def wait(self, job_id: str, timeout: float = 120, poll: float = 0.2) -> str:
        """Block until the job reaches a final state; returns it (raises on timeout)."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in FINAL_STATES:
                # with accounting the database may lag the controller by a moment
                return state
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not finished after {timeout:.0f}s (state {state})")


class TwoNodeSlurm(LocalSlurm):
    """A two-node cluster on this machine (`slurm/local/two_nodes.sh`): nodes n1 and n2 are
    network + UTS + mount/IPC namespaces joined by a veth link (own addresses, host names and
    /dev/shm), sharing the file system. No accounting. Clients run inside n1's network
    namespace (`run`, `sbatch`, `popen` do that); `node_pids(node)` finds a node's processes."""

    def __init__(self, state_dir: str | Path | None = None, *, cpus: int = 4, **kw) -> None:
        super().__init__(state_dir, with_dbd=False, cpus=cpus, **kw)
        self.tag = f"g{os.getpid() % 100000}"

    @property
    def interface(self) -> str:
        return "gpn0"  # the veth's name inside both nodes (GPN_SOCKET_IFNAME)

    def netns(self, node: str) -> str:
        return f"{self.tag}{'a' if node == 'n1' else 'b'}"

    def prefix(self, node: str = "n1") -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns(node)}"]

    def start(self) -> TwoNodeSlurm:
        env = self._script_env()
        env.update(SLURM_LOCAL_TAG=self.tag, SLURM_LOCAL_CPUS=str(self.cpus or 4))
        self.started = True
        try:
            proc = subprocess.run(
                ["bash", str(SCRIPTS / "two_nodes.sh"), "start"],
                env=env,
                text=True,
                capture_output=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired as err:
            self.start_failed = True
            raise SlurmStartError(f"two_nodes.sh start took over {self.timeout_s:.0f}s") from err
        if proc.returncode != 0:
            self.start_failed = True
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise SlurmStartError(f"slurm/local/two_nodes.sh failed: {tail}")
        return self

    def stop(self, purge: bool = False) -> str:
        proc = subprocess.run(
            ["bash", str(SCRIPTS / "two_nodes.sh"), "stop"],
            env=self._script_env(),
            text=True,
            capture_output=True,
            timeout=120,
        )
        self.started = False
        if self._purge_on_stop(purge):
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return proc.stdout + proc.stderr

    def run(
        self, args: Sequence[str], check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        return super().run([*self.prefix(), *args], check=check, timeout=timeout)

    def node_pids(self, node: str, needle: str) -> list[int]:
        """Processes in `node`'s network namespace whose command line contains `needle`."""
        target = os.stat(f"/run/netns/{self.netns(node)}").st_ino
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.stat(entry / "ns" / "net").st_ino != target:
                    continue
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if needle in cmd:
                out.append(int(entry.name))
        return out


def probe(x: int) -> dict:
    """A job payload for executor tests (importable by the job, unlike a test module's
    functions): 2*x, the SLURM job id and rank it ran under, and the host."""
    return {
        "x2": 2 * x,
        "job": os.environ.get("SLURM_JOB_ID"),
        "rank": os.environ.get("SLURM_PROCID"),
        "host": socket.gethostname(),
    }


# ----------------------------------------------------------------------------- fixtures
try:
    import pytest
except ImportError:  # pragma: no cover - library use without pytest
    pytest = None  # type: ignore[assignment]  # (the fixtures below check for None)

if pytest is not None:

    @pytest.fixture(scope="session")
    def slurm_cluster(tmp_path_factory) -> Iterator[LocalSlurm]:
        """A running local SLURM cluster (slurmctld, slurmd, munge, slurmdbd) for the session."""
        if shutil.which("bash") is None:
            pytest.fail("the local SLURM cluster needs bash")
        state = tmp_path_factory.mktemp("slurm")
        cluster = LocalSlurm(state)
        error = None
        try:
            cluster.start()
        except SlurmStartError as err:
            error = str(err)
        if error is not None:
            if cluster.started:
                cluster.stop()
            pytest.fail(f"could not start the local SLURM cluster: {error}", pytrace=False)
        try:
            yield cluster
        finally:
            cluster.stop()

    @pytest.fixture
    def slurm_env(slurm_cluster: LocalSlurm, monkeypatch) -> LocalSlurm:
        """`slurm_cluster`, with SLURM_CONF/PATH in os.environ for this test (submitit)."""
        env = slurm_cluster.env()
        monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
        monkeypatch.setenv("PATH", env["PATH"])
        return slurm_cluster
