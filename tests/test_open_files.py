"""`moe-serve` under a flood of connections: its open-file limit is raised at start, and accept() failures for
want of descriptors are logged once a minute instead of a traceback per connection (26,433 in 9 s once)."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

from moe_runtime.server.open_files import ACCEPT_FAILURE, AcceptFailureLog

REPO_ROOT = Path(__file__).resolve().parents[1]

# An asyncio server whose process has no descriptor left while 20 clients wait in its backlog.
STARVED_SERVER = textwrap.dedent("""
    import asyncio, logging, os, resource, socket, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    logging.basicConfig()
    from moe_runtime.server.open_files import AcceptFailureLog
    if sys.argv[1] == "filtered":
        AcceptFailureLog.install(logging.getLogger("asyncio"))

    async def main():
        server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0, backlog=100)
        clients = [socket.create_connection(server.sockets[0].getsockname()) for _ in range(20)]
        hog = []
        try:
            while True:
                hog.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        await asyncio.sleep(2.5)

    asyncio.run(main())
""")


def _run(*args: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)


def test_accept_failures_are_logged_once_not_per_connection():
    unfiltered = _run("plain", script=STARVED_SERVER)
    assert unfiltered.stderr.count("Traceback") >= 50, "the starved server should reproduce asyncio's flood"
    filtered = _run("filtered", script=STARVED_SERVER)
    assert "Traceback" not in filtered.stderr
    lines = [line for line in filtered.stderr.splitlines() if "HTTP cannot accept connections" in line]
    assert len(lines) == 1 and "Too many open files" in lines[0], filtered.stderr[-2000:]


def test_the_accept_failure_log_reports_what_it_dropped_each_interval():
    now = [0.0]
    log = AcceptFailureLog(interval_s=60.0, clock=lambda: now[0])

    def passes(message: str) -> bool:
        return log.filter(logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None))

    assert passes(ACCEPT_FAILURE + "\nsocket: <fd=3>")
    assert sum(passes(ACCEPT_FAILURE) for _ in range(1000)) == 0
    assert passes("some other asyncio error"), "only accept failures are thinned out"
    now[0] = 61.0
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, ACCEPT_FAILURE, None, None)
    assert log.filter(record) and "1000 such failures" in record.getMessage()


def test_the_soft_open_file_limit_is_raised_to_the_hard_one():
    script = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))
        from moe_runtime.server.open_files import raise_open_file_limit
        print(raise_open_file_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))
    """)
    assert _run(script=script).stdout.split() == ["1024", "1024", "1024"]
