"""How long the engine keeps working after a caller gives up: seconds from the cancel (or the client leaving) to
an idle engine, and the steps run meanwhile, on the embedded pair.

- library: ``llm.abatch`` of 32 prompts x ``--tokens`` tokens (EOS ignored), cancelled once decoding;
- ``asyncio.wait_for`` around ``llm.ainvoke`` expiring after ``--wait`` seconds;
- server (uvicorn on loopback): 4 clients posting ``n=4`` x ``--tokens`` tokens each (16 sequences), leaving
  once decoding (their connections closed).

    OMP_NUM_THREADS=1 python benchmarks/cancellation.py [--tokens 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import threading
import time

import uvicorn

from ead_llm import EntropyAdaptiveLLM
from ead_llm.core.engine import Engine
from ead_llm.serving.server import create_app


def until_idle(engine: Engine) -> tuple[float, int]:
    """Seconds and engine steps until nothing runs or waits, from now."""
    start, steps = time.perf_counter(), engine.steps
    while engine.load["running"] or engine.load["waiting"]:
        time.sleep(0.001)
    return time.perf_counter() - start, engine.steps - steps


async def until_decoding(engine: Engine) -> None:
    while not engine.load["running"]:
        await asyncio.sleep(0.001)


def library(llm: EntropyAdaptiveLLM, tokens: int) -> tuple[float, int]:
    prompts = [f"{1000 + i}+{2000 + i}-{300 + i}\n" for i in range(32)]

    async def main() -> tuple[float, int]:
        task = asyncio.ensure_future(llm.abatch(prompts, max_tokens=tokens))
        await until_decoding(llm.shared_engine)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return await asyncio.to_thread(until_idle, llm.shared_engine)

    return asyncio.run(main())


def wait_for(llm: EntropyAdaptiveLLM, tokens: int, seconds: float) -> tuple[float, int]:
    async def main() -> tuple[float, int]:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(llm.ainvoke("4821+3907-1568\n", max_tokens=tokens), seconds)
        return await asyncio.to_thread(until_idle, llm.shared_engine)

    return asyncio.run(main())


def server(llm: EntropyAdaptiveLLM, tokens: int) -> tuple[float, int]:
    app = create_app(llm)
    instance = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.01)
    port = instance.servers[0].sockets[0].getsockname()[1]
    body = json.dumps({"prompt": "4821+3907-1568\n", "max_tokens": tokens, "n": 4, "ignore_eos": True}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sockets = []
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(head.encode() + body)
        sockets.append(sock)
    engine = llm.shared_engine
    while engine.load["running"] < 16:
        time.sleep(0.001)
    for sock in sockets:
        sock.close()
    result = until_idle(engine)
    instance.should_exit = True
    thread.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wait", type=float, default=0.3, help="wait_for's timeout (s)")
    args = parser.parse_args()
    llm = EntropyAdaptiveLLM(ignore_eos=True)
    llm.invoke("1+1\n")  # load and warm up
    cases = {
        "abatch cancelled (32 sequences)": lambda: library(llm, args.tokens),
        f"wait_for({args.wait} s) expired": lambda: wait_for(llm, args.tokens, args.wait),
        "server clients left (16 sequences)": lambda: server(llm, args.tokens),
    }
    print(f"{'case':36} {'seconds to idle (median, max)':>30} {'steps after':>12}")
    for name, run in cases.items():
        results = [run() for _ in range(args.repeats)]
        seconds = [s for s, _ in results]
        steps = [n for _, n in results]
        print(f"{name:36} {statistics.median(seconds):16.3f} {max(seconds):12.3f} {max(steps):12d}")


if __name__ == "__main__":
    main()
