"""The command (tools/serve.py over runtime/serve/server.py) as a user runs it: it serves, a taken port
and bad arguments are one line of error, no traceback."""

from __future__ import annotations

import subprocess
import sys

import openai
import torch

from tests import decode_fixtures as fx
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import ROOT, start_cli
from tests.serve_fixtures import PROMPTS


def test_serve_command_line(tmp_path_factory, tmp_path, tp2_folder):
    folder = sf.tiny_folder(tmp_path_factory.getbasetemp())
    process, url, command = start_cli(
        str(folder), "--max-batch", "4", "--model-name", "tiny", "--log-level", "warning"
    )
    try:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = api.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=5, temperature=0)
        assert reply.choices[0].text == sf.words(fx.torch_greedy(PROMPTS[2], 5))
        # the port is taken now: a second server says so in one line
        again = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert again.returncode == 2 and again.stderr.startswith("error: cannot listen")
    finally:
        process.terminate()
        process.wait(timeout=30)
    for args, message in [
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(folder), "--backend", "tp"], "tp.json"),
        ([str(folder), "--max-batch", "0"], "--max-batch"),
        ([str(folder), "--default-max-tokens", "0"], "--default-max-tokens"),
        ([str(folder), "--request-read-timeout", "0"], "--request-read-timeout"),
        ([str(folder), "--keep-alive-timeout", "nan"], "--keep-alive-timeout"),
        ([str(folder), "--max-connections", "0"], "--max-connections"),
        # NCCL needs a GPU per rank: without them, one line before any rank process starts
        *([([str(tp2_folder), "--tp-comm", "nccl"], "2 GPUs")] if torch.cuda.device_count() < 2 else []),
    ]:
        result = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "serve.py"), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
