"""nginx with ``proxy_cache`` in front of a gateway, for tests and benchmarks: an HTTP cache
as a CDN edge would be, run in the foreground from a temp dir (config, pid, logs, cache)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from harness.ports import free_port
from harness.vllm_process import REPO_ROOT

CONFIG = """\
{user}worker_processes {workers};
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    large_client_header_buffers 4 16k;     # the gateway's GET forms take 8 KiB of query
    proxy_cache_path {dir}/cache levels=1:2 keys_zone=edge:10m max_size=256m inactive=1h
                     use_temp_path=off;
    upstream gateway {{
        server {upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://gateway;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache edge;
            proxy_cache_revalidate on;      # expired: ask with If-None-Match, keep on a 304
            proxy_cache_lock on;            # one request fills a missing entry
            add_header X-Cache-Status $upstream_cache_status always;
        }}
    }}
}}
"""
"""The edge: caches what the answers' ``Cache-Control`` allows (``public``; never ``private``
or ``no-store``), keyed by the URL; GET and HEAD only, as HTTP caches do by default."""


def nginx_binary() -> str | None:
    """The nginx binary; ``scripts/nginx.sh install`` is tried once when there is none.
    ``None`` when nginx cannot be installed here."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found:
        return found
    script = REPO_ROOT / "scripts" / "nginx.sh"
    try:
        subprocess.run(["bash", str(script), "install"], capture_output=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


class EdgeCache:
    """nginx on a free loopback port, caching in front of ``upstream`` (``host:port``)."""

    def __init__(self, binary: str, upstream: str, directory: Path, *, workers: int = 1) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None
        for sub in ("tmp", "cache"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        user = "user root;\n" if os.geteuid() == 0 else ""  # the workers write in the temp dir
        self.conf = directory / "nginx.conf"
        self.conf.write_text(
            CONFIG.format(
                user=user, workers=workers, dir=directory, upstream=upstream, port=self.port
            )
        )

    def start(self, timeout_s: float = 10.0, cpus: str | None = None) -> EdgeCache:
        """Start nginx (pinned to ``cpus``, e.g. ``"1"``, with taskset) and wait for its port."""
        cmd = [self.binary, "-p", str(self.dir), "-e", str(self.dir / "error.log"), "-c"]
        cmd.append(str(self.conf))
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"nginx exited: {err.strip()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("nginx did not open its port") from None
                time.sleep(0.02)

    def stop(self) -> None:
        """SIGQUIT (graceful), then SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(3)  # SIGQUIT: nginx's graceful shutdown
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
