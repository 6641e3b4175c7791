#!/usr/bin/env python3
"""Runs a training command that prints one `epoch i/N ... loss X` line per epoch and checks that
training did not turn back: the last epoch's loss is at most `ratio` times the lowest epoch
loss of the run (ctest examples_fashion_mnist_adaptive_long).

Usage: check_long_run.py <ratio> <command> [args...]
"""
import re
import subprocess
import sys

ratio = float(sys.argv[1])
run = subprocess.run(sys.argv[2:], capture_output=True, text=True)
sys.stdout.write(run.stdout[-2000:])
if run.returncode != 0:
    sys.stderr.write(run.stderr[-4000:])
    sys.exit(f"check_long_run: the command failed (exit {run.returncode})")
epoch_end = re.compile(r"epoch \d+/\d+ step (\d+)/\1\s+loss ([0-9.eE+-]+)")  # the epoch's last step
losses = [float(m.group(2)) for m in epoch_end.finditer(run.stdout)]
if len(losses) < 2:
    sys.exit(f"check_long_run: expected one loss per epoch, found {len(losses)}")
best, last = min(losses), losses[-1]
print(f"check_long_run: {len(losses)} epochs, lowest loss {best:.4g}, last {last:.4g} "
      f"(last/lowest {last / best:.2f}, allowed {ratio})")
sys.exit(0 if last <= ratio * best else 1)
