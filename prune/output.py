"""What `a3b prune` makes and says: where the pruned file goes, and the result it prints."""
from __future__ import annotations

import argparse
import json
import os
import site
import sysconfig
from pathlib import Path

from .config import PruneConfig, default_cache_dir
from .errors import InvalidRequest


def output_path(source: Path, args: argparse.Namespace) -> tuple[Path, str | None]:
    """--out, or a name beside the source, and a note to print when that name is not where the user
    would look; its folder must exist.

    A source inside the Python installation (the embedded model ships in a package) or in a folder this
    user cannot write gets its output under the cache folder instead: a package's folder is replaced
    or removed with the package, and is no place for the user's files. Checked before any work: the
    file is written only at the end, minutes into a run.
    """
    stem = source.name.removesuffix(".gguf")
    experts = f"e{args.expert_method}-{args.experts_keep:g}-" if getattr(args, "experts_keep", None) is not None else ""
    name = f"{stem}.a3b-{experts}{args.method}-{args.keep:g}.gguf"
    note = None
    if args.out:
        out = Path(args.out)
    elif _inside_python(source) or not os.access(source.parent, os.W_OK):
        out = default_cache_dir() / "out" / name
        out.parent.mkdir(parents=True, exist_ok=True)
        where = "inside the Python installation" if _inside_python(source) else "in a folder this user cannot write"
        note = f"a3b prune: {source.name} is {where}; the pruned file goes to {out} (--out chooses another place)"
    else:
        out = source.with_name(name)
    if not out.parent.is_dir():
        raise InvalidRequest(f"The folder of --out {out} does not exist; create it or choose another --out.")
    return out, note


def _inside_python(path: Path) -> bool:
    """Whether `path` lies in the Python installation: its standard library or any site-packages."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= set(getattr(site, "getsitepackages", list)()) | {site.getusersitepackages()}
    p = Path(path).resolve()
    return any(part in ("site-packages", "dist-packages") for part in p.parts) or any(
        p.is_relative_to(Path(r).resolve()) for r in roots if r)


def print_result(res, cfg: PruneConfig, *, as_json: bool) -> None:
    """Print the result of a run `res` (pipeline.prune's), as a line or with `as_json` as JSON."""
    summary = {"out": str(res.path), "n_ff": res.n_ff, "n_ff_source": res.n_ff_source,
               "keep_actual": res.n_ff / res.n_ff_source, "n_head": res.metadata["n_head"],
               "n_head_source": res.metadata["n_head_source"], "method": cfg.method,
               "recover_steps": len(res.distill_losses), "final_kl": res.metadata["recover.final_kl"],
               "seconds": res.timings}
    m = res.metadata
    if "n_expert" in m:
        summary.update({"n_expert": m["n_expert"], "n_expert_source": m["n_expert_source"],
                        "n_expert_used": m["n_expert_used"], "expert_method": m["experts.method"]})
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    if "n_expert" in m:
        print(f"wrote {res.path}: experts {m['n_expert']}/{m['n_expert_source']} per layer "
              f"({m['experts.method']}), {m['n_expert_used']} used per token, expert FFN width "
              f"{res.n_ff}/{res.n_ff_source} ({cfg.method}), {sum(res.timings.values()):.0f} s")
        return
    heads = res.metadata["n_head"], res.metadata["n_head_source"]
    print(f"wrote {res.path}: FFN width {res.n_ff}/{res.n_ff_source} ({res.n_ff / res.n_ff_source:.3f}), "
          + (f"query heads {heads[0]}/{heads[1]}, " if heads[0] != heads[1] else "") +
          f"method {cfg.method}, {len(res.distill_losses)} recovery steps, "
          f"{sum(res.timings.values()):.0f} s")
