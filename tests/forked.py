"""accutrain's commands started by forking a process that has already imported what every command imports (PyTorch
and the compiler modules torch.optim loads, Hydra, OmegaConf, matplotlib's Figure): each command is still a process of
its own — its pid, working directory, environment, pipes, signals and exit code, its console script's entry point
called with its argv — but it does not spend the 4-5 s of CPU that importing costs every fresh interpreter, most of a
small test run's. conftest.run_cli and conftest.start go through it; a test whose property is the start of a fresh
interpreter (what is imported before a refusal, Ctrl-C while importing, a process's peak memory) asks for the console
script itself (`fresh=True`).

The server (this file, run by `python -c "…runpy.run_path…" tests/forked.py SOCKET`, one per pytest process) imports,
then answers each connection: a JSON request (argv, cwd, environment) with the command's stdin, stdout and stderr as
file descriptors; it forks the command, sends its pid, and when it ends its exit code as subprocess reports it (-N:
killed by signal N)."""
from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Optional

PRELOAD = ["torch", "torch._dynamo", "torch.optim", "torch.utils.data", "numpy", "PIL.Image", "hydra", "omegaconf",
           "hydra._internal.hydra", "hydra._internal.utils", "hydra.core.utils", "matplotlib.figure",
           "matplotlib.backends.backend_agg", "accutrain.cli.main", "accutrain.cli.command", "accutrain.cli.job",
           "accutrain.cli.report", "accutrain.runtime.launch", "accutrain.train.build"]
# the console scripts and their entry points, as the installed package declares them (pyproject.toml)
ENTRY = {point.name: tuple(point.value.split(":"))
         for point in importlib.metadata.distribution("accutrain").entry_points if point.group == "console_scripts"}
INT = struct.Struct("i")


# --- the server ---------------------------------------------------------------------------------------------------
def serve(path: str) -> None:
    import ctypes
    import importlib

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the pytest process that started it
    clean_path = list(sys.path)
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    waiting: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for _ in selector.select(timeout=0.02):
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                conn.close()
                run_command(json.loads(message), fds, clean_path)  # never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(INT.pack(pid))
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(INT.pack(os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


def run_command(request: dict[str, Any], fds: list[int], clean_path: list[str]) -> None:
    """In the forked process: become the command (its fds, cwd, environment, argv, default signal handlers), run its
    entry point, end as the interpreter would (non-daemon threads joined, atexit handlers run, streams flushed)."""
    import importlib
    import traceback

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[:] = [os.path.dirname(script), *clean_path[1:]]
        module, function = ENTRY[os.path.basename(script)]
        try:
            getattr(importlib.import_module(module), function)()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 128 + signal.SIGINT
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# --- the client: a process of the pytest worker's ----------------------------------------------------------------
_server: Optional[tuple[subprocess.Popen, str, dict[str, str]]] = None
# variables read as the interpreter starts or as what the server imports loads (its thread pools, allocator, loader,
# matplotlib): a command whose differ from the server's is started anew. The others (a library's cache directory
# that an earlier test set in this process, say) are read later, from the command's own environment.
AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "MALLOC", "MPL", "TORCH_LOGS")


def at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(AT_START) and k != "PYTHONUNBUFFERED"}


def server(env: dict[str, str]) -> Optional[str]:
    """The socket of this pytest process's server (started on first use with `env`), or None where it cannot run
    or `env` differs from its own in what is read at start."""
    global _server
    if _server is not None and _server[0].poll() is None:
        return _server[1] if at_start(_server[2]) == at_start(env) else None
    if not hasattr(socket, "recv_fds") or not sys.platform.startswith("linux"):
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="accutrain-fork-"), "socket")
    proc = subprocess.Popen([sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], run_name='server')",
                             __file__, path], env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            return None
        time.sleep(0.05)
    atexit.register(proc.kill)
    _server = (proc, path, dict(env))
    return path


class Forked:
    """A command forked by the server, answering as subprocess.Popen does: pid, poll, wait, send_signal, kill,
    terminate, returncode, communicate (its stdout and stderr when they are pipes)."""

    def __init__(self, path: str, argv: list[str], cwd: Path, env: dict[str, str], stdin: Any, stdout: Any,
                 stderr: Any) -> None:
        self.args, self.returncode = argv, None
        self.stdout: Optional[IO[str]] = None
        self.stderr: Optional[IO[str]] = None
        def end(spec: Any, fd: int) -> int:  # the command's end (closed here once sent)
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                setattr(self, "stdout" if fd == 1 else "stderr", open(read, encoding="utf-8", errors="replace"))
                return write
            if spec == subprocess.STDOUT:
                return -1
            if spec is None:
                return os.dup(fd)
            if spec == subprocess.DEVNULL:
                return os.open(os.devnull, os.O_RDWR)
            return os.dup(spec if isinstance(spec, int) else spec.fileno())

        fds = [end(stdin, 0), end(stdout, 1), end(stderr, 2)]
        if fds[2] == -1:
            fds[2] = os.dup(fds[1])
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(path)
        socket.send_fds(self.conn, [json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode()], fds)
        for fd in set(fds):
            try:
                os.close(fd)
            except OSError:
                pass
        self.pid = INT.unpack(self._read(INT.size, None))[0]

    def _read(self, n: int, timeout: Optional[float]) -> bytes:
        self.conn.settimeout(timeout)
        data = b""
        while len(data) < n:
            chunk = self.conn.recv(n - len(data))
            if not chunk:
                raise OSError("the fork server went away")
            data += chunk
        return data

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                self.returncode = INT.unpack(self._read(INT.size, 0.0))[0]
            except (BlockingIOError, socket.timeout, TimeoutError):
                return None
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = INT.unpack(self._read(INT.size, timeout))[0]
            except (socket.timeout, TimeoutError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input: Any = None, timeout: Optional[float] = None) -> tuple[Optional[str], Optional[str]]:
        out: dict[str, str] = {}
        readers = [threading.Thread(target=lambda k=k, s=s: out.__setitem__(k, s.read()), daemon=True)
                   for k, s in (("out", self.stdout), ("err", self.stderr)) if s is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return out.get("out"), out.get("err")

    def __enter__(self) -> "Forked":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait()


def popen(argv: list[str], cwd: Path, env: dict[str, str], stdin: Any = None, stdout: Any = None,
          stderr: Any = None) -> Optional[Forked]:
    """The command forked from this process's server, or None where there is none (the caller starts it itself)."""
    if os.path.basename(argv[0]) not in ENTRY:
        return None
    path = server(env)
    return None if path is None else Forked(path, argv, cwd, env, stdin, stdout, stderr)


if __name__ == "server":
    serve(sys.argv[-1])  # python -c … tests/forked.py SOCKET
