"""The command line (python -m torch_sm70attn) run in a subprocess, for the tests."""

import os
import subprocess
import sys


def cli(*args, **env_vars):
    """`python -m torch_sm70attn *args`, its environment this one's plus env_vars (unbuffered):
    the finished subprocess.CompletedProcess, its output as text."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "torch_sm70attn", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
