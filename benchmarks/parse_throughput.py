"""Caption parsing throughput: captions per second with 1 and 2 processes on CC3M validation captions,
and the time this implies for CC12M (~12M captions).

    .venv/bin/python benchmarks/parse_throughput.py                 # 4000 captions, 1 and 2 processes
    .venv/bin/python benchmarks/parse_throughput.py --n 15833 --procs 1 2 4

The pipeline is loaded (and warmed up) before timing; worker processes are forked from the loaded parent,
so the numbers measure normalisation + nlp.pipe + tree derivation, not model loading. Pool start-up is
included in the multi-process timings. The load average is printed because a busy machine slows every row.
"""
import os, platform, sys, time
from pathlib import Path

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors

from powerclip.parsing import ParserConfig, load_pipeline, parse_captions, resolve_parser
from powerclip.tokens import default_tokenizer, tree_tokens

TSV = (Path(__file__).resolve().parents[1] / '..' / 'shared' / 'data' / 'cc3m_validation'
       / 'Validation_GCC-1.1.0-Validation.tsv')


def cpu_seconds() -> float:
    "User + system CPU time of this process and its finished children."
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--tsv', type=Path, default=TSV, help='CC3M-format file: caption<TAB>url per line')
    ap.add_argument('--n', type=int, default=4000, help='captions to parse (from the top of the file)')
    ap.add_argument('--procs', type=int, nargs='+', default=[1, 2], help='process counts to time')
    ap.add_argument('--parser', default='auto', choices=['auto', 'spacy', 'benepar'])
    ap.add_argument('--batch-size', type=int, default=256)
    ap.add_argument('--total', type=float, default=12e6, help='captions to extrapolate to (CC12M: ~12M)')
    ap.add_argument('--debug', action='store_true', help='show the traceback of a usage error')
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.existing('--tsv', a.tsv, hint='a CC3M-format file: caption<TAB>url per line')
        _checks.at_least(a, 1, 'n', 'procs', 'batch-size')
        if a.total <= 0:
            raise ValueError(f'--total: must be above 0, got {a.total}')
    with open(a.tsv, encoding='utf-8') as f:
        caps = [line.split('\t')[0] for line, _ in zip(f, range(a.n))]
    cfg = ParserConfig(name=a.parser, batch_size=a.batch_size)
    name, why = resolve_parser(cfg)
    load_pipeline(name, cfg.spacy_model, cfg.benepar_model)
    parse_captions(caps[:64], cfg)                                           # warm-up
    default_tokenizer()
    print(f'machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPU cores, python '
          f'{platform.python_version()}, load average {os.getloadavg()[0]:.1f} before timing')
    print(f'parser: {name} ({why}); {len(caps)} CC3M validation captions; batch size {a.batch_size}\n')
    print(f"| processes | captions | wall s | captions/s | est. {a.total / 1e6:.0f}M captions | CPU s (all processes) "
          f"| captions per CPU-s |")
    print('|---:|---:|---:|---:|---:|---:|---:|')
    for p in a.procs:
        c0, t0 = cpu_seconds(), time.perf_counter()
        out = parse_captions(caps, cfg, n_process=p)
        dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        assert len(out) == len(caps)
        rate = len(caps) / dt
        print(f'| {p} | {len(caps)} | {dt:.1f} | {rate:.0f} | {a.total / rate / 3600:.1f} h | {cpu:.1f} '
              f'| {len(caps) / cpu:.0f} |', flush=True)
    print(f'\n(captions per CPU-s does not depend on other load: {a.total / 1e6:.0f}M captions need '
          f'{a.total / (len(caps) / cpu) / 3600:.1f} CPU-hours, i.e. that divided by the idle cores used)')
    for pc in out[:64]:
        tree_tokens(pc)                                      # warm-up (word-piece cache starts cold)
    t0 = time.perf_counter()
    for pc in out:
        tree_tokens(pc)
    dt = time.perf_counter() - t0
    print(f'\ntree_tokens (1 process): {len(out) / dt:.0f} captions/s; load average after: {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    sys.exit(run_main(main, prog='parse_throughput.py'))
