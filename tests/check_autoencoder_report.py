#!/usr/bin/env python3
"""scripts/autoencoder_report.py's target lines on synthetic runs (standard library only):
self-tuned K-FAC reaching the goal on every seed is judged (MET here), and a full run where it
misses the goal on one seed is a MISSED naming how many seeds reached it (not NOT MEASURED).

  check_autoencoder_report.py SOURCE_DIR"""
import pathlib
import subprocess
import sys
import tempfile

HEADER = 'optimizer,lr,damping,seed,step,seconds,train_error,train_loss\n'


def curve(opt, lr, damping, seed, errors):
    """Rows every 10 s, 100 steps apart."""
    return ''.join(f'{opt},{lr},{damping},{seed},{100 * i},{10.0 * i:.3f},{e},{e}\n' for i, e in enumerate(errors))


def runs(self_tuned_seed2):
    text = HEADER
    for seed in (1, 2, 3):
        text += curve('sgd', 0.01, '-', seed, [100, 60, 40, 30, 25, 20])     # final 20
        text += curve('adam', 0.001, '-', seed, [100, 50, 30, 20, 16, 15])   # final 15: the goal
        text += curve('kfac', 0.3, 0.1, seed, [100, 30, 14, 10, 9, 8])       # 15 at 20 s
        errors = [100, 14, 9, 7, 6, 5] if seed != 2 else self_tuned_seed2
        text += curve('kfac+adaptive', 'auto', 0.001, seed, errors)          # 15 at 10 s
    return text


def report(source, text):
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / 'runs.csv'
        path.write_text(text)
        out = subprocess.run([sys.executable, str(source / 'scripts/autoencoder_report.py'), str(path), '--out', d,
                              '--seeds', '3', '--budget', '50'], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.startswith('target ')]


def main():
    source = pathlib.Path(sys.argv[1])
    failures = []
    good = report(source, runs([100, 14, 9, 7, 6, 5]))
    # 10 s of Adam's 50 s: 0.2 <= 0.3; 10 s against tuned K-FAC's 20 s: 0.5 <= 1.25.
    if len(good) != 2 or not all(': MET (' in line for line in good):
        failures.append(f'every seed reaching the goal: expected two MET lines, got {good}')
    bad = report(source, runs([100, 180, 190, 194, 192, 194]))
    if len(bad) != 2 or not all(': MISSED (' in line and '2 of 3 seeds' in line for line in bad):
        failures.append(f'seed 2 never reaching the goal: expected two MISSED lines naming 2 of 3 seeds, got {bad}')
    for f in failures:
        print('check_autoencoder_report:', f)
    print('check_autoencoder_report:', 'FAILED' if failures else 'both cases as expected')
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
