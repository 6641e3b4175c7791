"""Fashion-MNIST with SGD and SGD + kfac from Python (docs/python.md).

    PYTHONPATH=build/python python3 examples/python/train.py --epochs 3 --seeds 1
    PYTHONPATH=build/python torchrun --nproc_per_node 2 examples/python/train.py --epochs 1

The C++ LibTorch example's CNN (conv 1->16 3x3, BatchNorm, ReLU, max-pool, conv 16->32,
BatchNorm, ReLU, max-pool, Linear 1568->10; convolutions without bias), trained by SGD (momentum
0.9) and by the same SGD with kfac.KFACPreconditioner.step() before each optimizer step, from the
same initialisation and batch order. The data are Debian's raw IDX files
(/usr/share/datasets/fashion-mnist, package dataset-fashion-mnist) read by torchvision with
download=False, after a one-time gunzip into --cache. Under torchrun every rank trains its shard
(DistributedSampler) under DistributedDataParallel over gloo, and kfac averages its factors over
the ranks. Prints a progress line per evaluation, a table per run, a summary, and writes a CSV log.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import pathlib
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

import kfac

FILES = ['train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte']


def dataset(source: str, cache: str, train: bool) -> torchvision.datasets.FashionMNIST:
    raw = pathlib.Path(cache) / 'FashionMNIST' / 'raw'
    raw.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if not (raw / name).exists():
            src = pathlib.Path(source) / f'{name}.gz'
            if not src.exists():
                raise SystemExit(f'{src} not found (Debian package dataset-fashion-mnist, or --data)')
            tmp = raw / f'{name}.part{os.getpid()}'
            with gzip.open(src, 'rb') as f, open(tmp, 'wb') as g:
                shutil.copyfileobj(f, g)
            tmp.replace(raw / name)
    tf = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                         torchvision.transforms.Normalize((0.2860,), (0.3530,))])
    return torchvision.datasets.FashionMNIST(cache, train=train, download=False, transform=tf)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def evaluate(model: torch.nn.Module, loader) -> float:
    model.eval()
    right = total = 0
    with torch.no_grad():
        for x, y in loader:
            right += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    model.train()
    return 100.0 * right / total


def run(args, optimizer_name: str, seed: int, train, test, rank: int, world: int, log) -> dict:
    torch.manual_seed(seed)
    model = Net()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    sampler = torch.utils.data.distributed.DistributedSampler(train, world, rank, shuffle=True, seed=seed) \
        if world > 1 else None
    gen = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch // world, shuffle=sampler is None,
                                         sampler=sampler, generator=gen, drop_last=True)
    test_loader = torch.utils.data.DataLoader(test, batch_size=1000)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    pre = None
    if optimizer_name == 'kfac':
        pre = kfac.KFACPreconditioner(model, lr=args.lr, damping=args.damping, kl_clip=args.kl_clip,
                                      factor_decay=args.factor_decay, factor_update_steps=args.factor_every,
                                      inv_update_steps=args.inv_every, conventions=args.conventions)
    per_epoch = len(loader)
    eval_every = max(1, per_epoch // args.evals_per_epoch)
    step, train_s, reached, best, acc = 0, 0.0, None, 0.0, 0.0
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if pre is not None:
                pre.step()
            opt.step()
            train_s += time.perf_counter() - t0
            step += 1
            if step % eval_every == 0 or step == per_epoch * args.epochs:
                acc = evaluate(model, test_loader)
                best = max(best, acc)
                ep = step / per_epoch
                if reached is None and acc >= args.target:
                    reached = (ep, train_s)
                if rank == 0:
                    print(f'{optimizer_name:5s} seed {seed} epoch {ep:5.2f} step {step:5d} loss {loss.item():.4f} '
                          f'test {acc:6.2f}% train {train_s:7.1f}s', flush=True)
                    log.writerow([optimizer_name, seed, args.lr, f'{ep:.3f}', step, f'{train_s:.3f}',
                                  f'{loss.item():.5f}', f'{acc:.2f}'])
    return dict(optimizer=optimizer_name, seed=seed, final=acc, best=best, reached=reached, train_s=train_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--data', default='/usr/share/datasets/fashion-mnist')
    ap.add_argument('--cache', default=os.path.expanduser('~/.cache/kfac/fashion-mnist'))
    ap.add_argument('--epochs', type=int, default=3)
    ap.add_argument('--seeds', default='1', help='comma-separated, e.g. 1,2,3')
    ap.add_argument('--optimizers', default='sgd,kfac')
    ap.add_argument('--batch', type=int, default=256, help='global batch (divided over the ranks)')
    ap.add_argument('--lr', type=float, default=0.05)
    ap.add_argument('--damping', type=float, default=0.1)
    ap.add_argument('--conventions', default='kfac', choices=['kfac', 'kfac-pytorch'],
                    help="kfac's factors (the C++ demo's, whose damping this uses) or kfac-pytorch's")
    ap.add_argument('--kl-clip', type=float, default=1e-3)
    ap.add_argument('--factor-decay', type=float, default=0.95)
    ap.add_argument('--factor-every', type=int, default=10)
    ap.add_argument('--inv-every', type=int, default=100)
    ap.add_argument('--target', type=float, default=88.0, help='test accuracy whose time is reported')
    ap.add_argument('--evals-per-epoch', type=int, default=4)
    ap.add_argument('--train-subset', type=int, default=0)
    ap.add_argument('--test-subset', type=int, default=0)
    ap.add_argument('--threads', type=int, default=1)
    ap.add_argument('--out', default='results_python')
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    world = int(os.environ.get('WORLD_SIZE', '1'))
    rank = int(os.environ.get('RANK', '0'))
    if world > 1:
        dist.init_process_group('gloo')
    train = dataset(args.data, args.cache, True) if rank == 0 or world == 1 else None
    if world > 1:
        dist.barrier()  # rank 0 unpacked the files
        train = train or dataset(args.data, args.cache, True)
    test = dataset(args.data, args.cache, False)
    if args.train_subset:
        train = torch.utils.data.Subset(train, range(args.train_subset))
    if args.test_subset:
        test = torch.utils.data.Subset(test, range(args.test_subset))
    os.makedirs(args.out, exist_ok=True)
    results = []
    with open(os.path.join(args.out, f'log_rank{rank}.csv'), 'w', newline='') as f:
        log = csv.writer(f)
        log.writerow(['optimizer', 'seed', 'lr', 'epoch', 'step', 'train_s', 'train_loss', 'test_acc'])
        for seed in [int(s) for s in args.seeds.split(',')]:
            for name in args.optimizers.split(','):
                results.append(run(args, name, seed, train, test, rank, world, log))
    if rank == 0:
        print(f'\n| optimizer | seed | final test acc | best | epochs to {args.target:g}% | train s to {args.target:g}% | train s |')
        print('|---|---|---|---|---|---|---|')
        for r in results:
            ep, s = r['reached'] if r['reached'] else (None, None)
            print(f"| {r['optimizer']} | {r['seed']} | {r['final']:.2f}% | {r['best']:.2f}% | "
                  f"{'-' if ep is None else f'{ep:.2f}'} | {'-' if s is None else f'{s:.1f}'} | {r['train_s']:.1f} |")
        sgd = [r['reached'][1] for r in results if r['optimizer'] == 'sgd' and r['reached']]
        kf = [r['reached'][1] for r in results if r['optimizer'] == 'kfac' and r['reached']]
        if sgd and kf:
            print(f'\nK-FAC reaches {args.target:g}% in {sum(kf) / len(kf) / (sum(sgd) / len(sgd)):.2f}x the training '
                  f'time of SGD (means over the seeds where both reach it; {world} process(es))')
        else:
            print(f'\n{args.target:g}% not reached by both optimizers')
    if world > 1:
        dist.destroy_process_group()


if __name__ == '__main__':
    main()
