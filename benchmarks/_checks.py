"""Argument checks shared by the benchmark scripts (the project's command-line convention, `powerclip.commandline`).

Each raises a ValueError whose message starts with the argument; a script calls them inside
`powerclip.commandline.usage_errors()`, so a mistake is one line on stderr and exit status 2 before anything is
measured.
"""
from pathlib import Path


def at_least(args, lo: int, *names: str) -> None:
    """Every `--name` (one value or a list of them) is a finite number of at least `lo` (`check_number`: NaN, which
    passes `x < lo`, is refused too)."""
    from powerclip.commandline import check_number
    for n in names:
        v = getattr(args, n.replace('-', '_'))
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            check_number(f'--{n}', x, lo)


def device(name: str):
    """A torch device that exists here: `--device` cpu, cuda, cuda:N (a GPU must be present;
    `powerclip.commandline.check_device`)."""
    import torch
    from powerclip.commandline import check_device
    return torch.device(check_device('--device', name))


def arch(flag: str, name: str) -> None:
    "An open_clip architecture the project knows (read from its config; nothing is built)."
    from powerclip.model import model_geometry
    try:
        model_geometry(name)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f'{flag}: {e}') from None


def existing(flag: str, path, kind: str = 'file', hint: str = '') -> Path:
    "`path` exists and is a file (kind='file') or a folder (kind='dir')."
    p = Path(path)
    ok = p.is_file() if kind == 'file' else p.is_dir()
    if not ok:
        raise ValueError(f"{flag}: no {'folder' if kind == 'dir' else 'file'} {str(p)!r}"
                         + (f' ({hint})' if hint else ''))
    return p


def output(flag: str, path) -> None:
    "An output file's place: not a folder, not inside a file."
    p = Path(path)
    if p.is_dir():
        raise ValueError(f'{flag}: {str(p)!r} is a folder (give a file name)')
    if any(a.exists() and not a.is_dir() for a in p.parents):
        raise ValueError(f'{flag}: {str(p)!r} is inside a file')


def out_dir(flag: str, path) -> Path:
    "A folder for outputs (created later when missing): not a file, not inside a file."
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag}: {str(p)!r} is a file (give a folder)")
    if any(a.exists() and not a.is_dir() for a in p.parents):
        raise ValueError(f"{flag}: {str(p)!r} is inside a file")
    return p
