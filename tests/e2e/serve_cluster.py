"""`tandem serve` as a user runs it, for fault tests: find its children, stream, check what is left."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time

import httpx

from tandem.redis_server import free_port


def children(pid: int) -> dict[str, int]:
    """The supervisor's children by name: redis, gateway, prefill-0, decode-1, ..."""
    found = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] == "Z":
                continue
            with open(stat[:-len("stat")] + "cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        child = int(stat.split("/")[2])
        if any("redis-server" in a for a in argv):
            found["redis"] = child
        elif "--worker-id" in argv:
            found[argv[argv.index("--worker-id") + 1]] = child
        elif "gateway" in argv:
            found["gateway"] = child
    return found


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


class Serve:
    def __init__(self, model: str, tmp_path, *extra: str, num_decode: int = 1, num_prefill: int = 1,
                 pools: str = "separate"):
        """``pools``: separate by default, the disaggregated design these fault tests are about
        (``tandem serve`` itself runs colocated pools on one device)."""
        self.port, self.admin_port = free_port(), free_port()
        self.pools = pools
        self.model = os.path.basename(model)
        self.err_path = tmp_path / "serve.err"
        # its decode pools' files in a directory of its own: another test's cluster may run beside it
        self.shm_dir = str(tmp_path / "shm")
        env = {**os.environ, "OMP_NUM_THREADS": "1",  # two cores: workers must not starve each other
               "TANDEM_SHM_DIR": self.shm_dir}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem", "serve", "--model", model, "--port", str(self.port),
             "--admin-port", str(self.admin_port), "--tokens-per-block", "4", "--max-seq-len", "256",
             "--max-num-tokens", "32", "--heartbeat-ttl-s", "2", "--heartbeat-interval-s", "0.5",
             "--num-decode-workers", str(num_decode), "--num-prefill-workers", str(num_prefill),
             "--pools", pools, *extra],
            stdout=subprocess.PIPE, stderr=open(self.err_path, "wb"), text=True, env=env)
        line = self.proc.stdout.readline()
        if f":{self.port}/v1" not in line:
            self.stop()
            raise RuntimeError(f"tandem serve did not start: {line!r}\n{self.log()}")
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.pids = children(self.proc.pid)

    def pool_files(self) -> set[str]:
        """Its decode workers' shm pool files."""
        return set(glob.glob(os.path.join(self.shm_dir, "tandem-kv-*")))

    def log(self) -> str:
        return self.err_path.read_text()[-6000:]

    def workers(self) -> list[dict]:
        done = subprocess.run([sys.executable, "-m", "tandem", "admin", "--address", f"127.0.0.1:{self.admin_port}",
                               "workers"], capture_output=True, text=True, timeout=60)
        return json.loads(done.stdout)["workers"] if done.returncode == 0 else []

    def wait_blocks_free(self, timeout_s: float = 30.0) -> list[dict]:
        """Every pool's free blocks back to its total (what the registry reports), every role there."""
        roles = {"decode"} if self.pools == "colocated" else {"decode", "prefill"}
        deadline = time.monotonic() + timeout_s
        while True:
            decode = self.workers()
            if {w["role"] for w in decode} == roles and \
                    all(w["num_free_blocks"] == w["num_total_blocks"] for w in decode):
                return decode
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks not given back: {decode}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 60.0) -> int:
        pids = children(self.proc.pid) if self.proc.poll() is None else {}
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        deadline = time.monotonic() + 10
        while any(running(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [name for name, p in pids.items() if running(p)]
        assert not left, f"still running after tandem serve exited: {left}"
        return code


class Stream(threading.Thread):
    """One greedy completion stream; keeps the token ids and how it ended."""

    def __init__(self, base_url: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool = False):
        super().__init__(daemon=True)
        self.url, self.body = f"{base_url}/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "ignore_eos": ignore_eos}  # without it, EOS ends it as it ends HF generate()
        self.token_ids: list[int] = []
        self.arrivals: list[float] = []  # monotonic time of each chunk that carried tokens
        self.finish: str | None = None
        self.error: str | None = None
        self.done = False
        self.status: int | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=180) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        self.done = True
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        self.error = event["error"]["message"]
                        continue
                    choice = event["choices"][0]
                    if choice.get("token_ids"):
                        self.arrivals.append(time.monotonic())
                    self.token_ids += choice.get("token_ids") or []
                    self.finish = choice.get("finish_reason") or self.finish
        except Exception as exc:  # reported by the test's assertions
            self.error = repr(exc)


def start_streams(serve: Serve, prompts: list[str], max_tokens: int) -> list[Stream]:
    streams = [Stream(serve.base_url, serve.model, p, max_tokens) for p in prompts]
    for stream in streams:
        stream.start()
    return streams


def wait_tokens(streams: list[Stream], num_tokens: int, timeout_s: float = 60.0) -> None:
    """Until every stream has at least ``num_tokens`` tokens (they decode now)."""
    deadline = time.monotonic() + timeout_s
    while any(len(s.token_ids) < num_tokens for s in streams):
        if time.monotonic() > deadline or any(s.error for s in streams):
            raise AssertionError([(len(s.token_ids), s.error) for s in streams])
        time.sleep(0.02)


def record_fault(fault: str, streams: list[Stream], expected: list[list[int]], fault_at: float,
                 leaked_blocks: int) -> dict:
    """One row of docs/reliability.md: appended to $TANDEM_RELIABILITY_OUT (JSON lines) when set."""
    lost = repeated = 0
    for stream, want in zip(streams, expected):
        got = stream.token_ids
        common = 0
        while common < min(len(got), len(want)) and got[common] == want[common]:
            common += 1
        lost += len(want) - common
        repeated += len(got) - common
    # the longest wait for tokens after the fault (from the fault itself, for a stream that had none)
    pauses = [max((b - a for a, b in zip([fault_at, *s.arrivals], s.arrivals) if b >= fault_at), default=0.0)
              for s in streams]
    row = {"fault": fault, "requests": len(streams), "completed": sum(s.done and s.error is None for s in streams),
           "tokens_lost": lost, "tokens_repeated": repeated, "blocks_leaked": leaked_blocks,
           "longest_pause_s": round(max(pauses, default=0.0), 2)}
    out = os.environ.get("TANDEM_RELIABILITY_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row
