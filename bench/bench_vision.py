"""Images in: the projector's encode time per image and the first-token latency of a chat request
with an image against the same request without it, beside llama.cpp's own llama-mtmd-cli on the
same files in the same run.

Everything is written here with random weights: a text model (Q4_0) and its projector (f16
matrices) at a real shape, and random RGB PNG images at the projector's native size.

* **encode**: the vision tower's time for one image (libmtmd's `mtmd_encode_chunk` through the
  runtime's projector), each image new to its cache; llama-mtmd-cli reports the same span for each
  image it reads ("mtmd batch encoding done in N ms"). Target: within 1.2x of llama-mtmd-cli.
* **first token**: `Runtime.generate(max_tokens=1)` wall time for a chat with a new image, for the
  same chat without it (both begin with a number of their own, so no request reuses another's KV
  cache), and for the image request queued again with another seed (the image is neither encoded
  nor read again: its KV cache is reused).

    python -m comfyui_a3b.bench.bench_vision --out DIR [--bin FOLDER] [--pair qwen2-vl|llava|tiny|tiny-mlp]

Without llama-mtmd-cli (no --bin, or not in it) its columns are recorded as skipped, with the reason.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .models import SHAPES as TEXT_SHAPES
from .models import write_model
from .common import arguments, device_label, median
from .mmproj import SHAPES as PROJECTOR_SHAPES
from .mmproj import write_mmproj

#: a projector and the text model it feeds; image_px: the side of the square test images
PAIRS = {
    # Qwen2-VL-2B: the vision tower of mmproj.py's qwen2-vl shape, the 2B text model
    # (https://huggingface.co/Qwen/Qwen2-VL-2B-Instruct/blob/main/config.json); 448 px = 256 image tokens
    "qwen2-vl": dict(projector="qwen2-vl", arch="qwen2vl", image_px=448,
                     text=dict(n_layer=28, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2, head_dim=128,
                               n_vocab=151936)),
    # LLaVA-1.5's CLIP ViT-L/14-336 (576 image tokens) into a Qwen3-8B-shaped text model
    "llava": dict(projector="clip-l-336", arch="qwen3", image_px=336, text=TEXT_SHAPES["qwen3-8b"]),
    "tiny": dict(projector="tiny-qwen2vl", arch="qwen2vl", image_px=112, text=TEXT_SHAPES["tiny"]),
    "tiny-mlp": dict(projector="tiny-mlp", arch="qwen3", image_px=56, text=TEXT_SHAPES["tiny"]),
}


def say(msg: str) -> None:
    print(msg, flush=True)


def write_files(out: Path, pair: str, n_images: int) -> dict:
    """The text model, the projector and 3 x n_images + 1 random images (encode set, first-token set,
    CLI set, warm-up): PNG files for llama-mtmd-cli, the same pixels for the runtime (no decoder needed)."""
    from comfyui_a3b.runtime.images import RGBImage, png_bytes

    p = PAIRS[pair]
    real = not pair.startswith("tiny")
    model = out / f"random-{pair}-text.q4_0.gguf"
    proj = out / f"mmproj-random-{pair}.gguf"
    took = {}
    if not model.exists():
        t0 = time.perf_counter()
        write_model(model, p["text"], arch=p["arch"])
        took["write_text_s"] = time.perf_counter() - t0
        say(f"wrote {model.name} ({model.stat().st_size / 2**30:.2f} GiB) in {took['write_text_s']:.1f} s")
    if not proj.exists():
        t0 = time.perf_counter()
        write_mmproj(proj, p["text"]["n_embd"], p["projector"], dtype=np.float16 if real else np.float32)
        took["write_projector_s"] = time.perf_counter() - t0
        say(f"wrote {proj.name} ({proj.stat().st_size / 2**30:.2f} GiB) in {took['write_projector_s']:.1f} s")
    rng = np.random.default_rng(1)
    side = p["image_px"]
    images, pixels = [], []
    for i in range(3 * n_images + 1):
        path = out / f"image-{pair}-{i}.png"
        rgb = rng.integers(0, 256, (side, side, 3), dtype=np.uint8).tobytes()
        if not path.exists():
            path.write_bytes(png_bytes(RGBImage(side, side, rgb, "")))
        images.append(path)
        pixels.append((side, rgb))
    return {"model": model, "projector": proj, "images": images, "pixels": pixels, **took}


def gpu_layers() -> int:
    from comfyui_a3b.runtime.llama.binding import llama

    return -1 if llama().llama_supports_gpu_offload() else 0


def ours(files: dict, n_images: int, n_ctx: int) -> dict:
    """Encode times and first-token latencies through the runtime (one process, one model)."""
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.runtime.generation import SamplingParams
    from comfyui_a3b.runtime.images import decode
    from comfyui_a3b.runtime.llama.vision import ImageChunk
    from comfyui_a3b.runtime.requests import ChatPrompt, ImagePart

    rt = get_runtime()
    t0 = time.perf_counter()
    spec = rt.spec(str(files["model"]), n_ctx=n_ctx, n_parallel=1, n_gpu_layers=gpu_layers(),
                   mmproj=str(files["projector"]))
    model = rt.load(spec)
    load_s = time.perf_counter() - t0
    vision = model.vision
    if vision is None:
        raise RuntimeError("the projector did not load")
    say(f"runtime: loaded in {load_s:.1f} s (projector {vision.info.size_bytes / 2**30:.2f} GiB, "
        f"M-RoPE {vision.info.mrope})")
    imgs = [ImagePart(rgb=rgb, width=side, height=side) for side, rgb in files["pixels"]]

    def chat(i: int, image: ImagePart | None) -> ChatPrompt:
        text = f"Request {i}: describe the picture in one line."
        return ChatPrompt(({"role": "user", "content": (text, image) if image is not None else (text,)},))

    def first_token(prompt, seed: int) -> float:
        t = time.perf_counter()
        rt.generate(prompt, model=spec, max_tokens=1, sampling=SamplingParams(temperature=0, seed=seed))
        return (time.perf_counter() - t) * 1000

    first_token(chat(-1, imgs[-1]), 0)   # warm-up: graphs and buffers of both paths
    first_token(chat(-2, None), 0)
    encode, n_tokens = [], 0
    for im in imgs[:n_images]:
        pieces = vision.tokenize(f"look: {vision.marker}", [decode(im)], True)
        chunk = next(p for p in pieces if isinstance(p, ImageChunk))
        n_tokens = chunk.n_tokens
        t = time.perf_counter()
        vision.embedding(chunk)
        encode.append((time.perf_counter() - t) * 1000)
        chunk.free()
    say(f"runtime: encode ms per image {[round(x, 1) for x in encode]} ({n_tokens} tokens each)")
    with_image, without, requeue = [], [], []
    hits0 = vision.stats["cache_hits"]
    for k, im in enumerate(imgs[n_images:2 * n_images]):
        with_image.append(first_token(chat(100 + k, im), 1))
        requeue.append(first_token(chat(100 + k, im), 2))   # the same request again, another seed
        without.append(first_token(chat(200 + k, None), 1))
    say(f"runtime: first token ms with image {[round(x) for x in with_image]}, without {[round(x) for x in without]}, "
        f"queued again {[round(x) for x in requeue]}")
    n_prompt_text = model.count_tokens(chat(999, None))
    rt.unload(spec)
    return {"load_s": load_s, "image_tokens": n_tokens, "prompt_tokens_text": n_prompt_text,
            "encode_ms": encode, "encode_ms_median": median(encode),
            "first_token_image_ms": with_image, "first_token_text_ms": without, "first_token_requeue_ms": requeue,
            "first_token_image_ms_median": median(with_image), "first_token_text_ms_median": median(without),
            "first_token_requeue_ms_median": median(requeue),
            "projector_cache_hits_on_requeue": vision.stats["cache_hits"] - hits0,
            "projector_stats": dict(vision.stats)}


def encode_times(text: str) -> list[float]:
    """Encode times per image in llama-mtmd-cli's log: older builds say "image slice encoded in N ms",
    this one "mtmd batch encoding done in N ms" (one line per batch, one image per batch here)."""
    return [float(x) for x in re.findall(r"(?:image slice encoded in|mtmd batch encoding done in) (\d+) ms", text)]


def mtmd_cli(binary: Path, files: dict, n_images: int, n_ctx: int) -> dict:
    """llama-mtmd-cli on the same model, projector and (other) images: its encode time per image."""
    if not binary.exists():
        return {"skipped": f"{binary} not found"}
    imgs = files["images"][2 * n_images:3 * n_images]
    # the random model has no chat template: llama-mtmd-cli refuses a model without one, and the
    # runtime falls back to ChatML too
    cmd = [str(binary), "-m", str(files["model"]), "--mmproj", str(files["projector"]), "-p",
           "Describe the pictures in one line.", "-n", "1", "--temp", "0", "-c", str(n_ctx),
           "--chat-template", "chatml", "-ngl", "99" if gpu_layers() else "0"]
    for p in imgs:
        cmd += ["--image", str(p)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = r.stdout + r.stderr
    enc = encode_times(text)
    dec = [float(x) for x in re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", text)]
    if r.returncode != 0 or not enc:
        return {"error": f"exit {r.returncode}: {text[-1500:]}"}
    return {"command": " ".join(cmd), "wall_s": time.perf_counter() - t0, "encode_ms": enc,
            "encode_ms_median": median(enc), "decode_ms": dec}


def report(res: dict, out: Path) -> None:
    o, c = res.get("ours", {}), res.get("mtmd_cli", {})
    rows = []
    ratio = None
    if "encode_ms_median" in o:
        ref = c.get("encode_ms_median")
        ratio = o["encode_ms_median"] / ref if ref else None
        rows.append(["encode, ms per image (median)", f"{o['encode_ms_median']:.1f}",
                     f"{ref:.1f}" if ref else c.get("skipped") or c.get("error", "-")[:60],
                     f"{ratio:.2f}x" if ratio else "-"])
        rows.append(["first token, chat with a new image, ms", f"{o['first_token_image_ms_median']:.0f}", "-", "-"])
        rows.append(["first token, the same chat without it, ms", f"{o['first_token_text_ms_median']:.0f}", "-", "-"])
        rows.append(["first token, the image chat queued again, ms", f"{o['first_token_requeue_ms_median']:.0f}",
                     "-", "-"])
    res["encode_ratio_vs_mtmd_cli"] = ratio
    res["target_met"] = None if ratio is None else ratio <= 1.2
    head = ["", "a3b runtime", "llama-mtmd-cli", "ratio (target <= 1.2x)"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in [head, *rows]]
    say("\n".join(lines))
    title = f"{res['pair']}: {o.get('image_tokens', '?')} image tokens, on {res.get('device', '?')}"
    md = [f"# bench_vision: {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * 4]
    md += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    (out / "bench_vision.md").write_text("\n".join(md) + "\n")
    (out / "bench_vision.json").write_text(json.dumps(res, indent=2, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if "encode_ms" not in o:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    a1.bar(["a3b runtime", "llama-mtmd-cli"], [o["encode_ms_median"], c.get("encode_ms_median") or 0])
    a1.set_ylabel("encode ms per image (median)")
    a2.bar(["image", "no image", "image again"], [o["first_token_image_ms_median"], o["first_token_text_ms_median"],
                                                  o["first_token_requeue_ms_median"]])
    a2.set_ylabel("first token ms (median)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "bench_vision.png", dpi=110)


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--out", required=True, help="folder for the files, bench_vision.{md,json,png}")
    ap.add_argument("--pair", choices=PAIRS, default="qwen2-vl")
    ap.add_argument("--bin", default=os.environ.get("BIN"), help="folder with llama-mtmd-cli (default: $BIN)")
    ap.add_argument("--images", type=int, default=6, help="images per measurement")
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"pair": args.pair, "projector_shape": PROJECTOR_SHAPES[PAIRS[args.pair]["projector"]],
                 "command": " ".join(sys.argv), "images": args.images}
    res["device"] = device_label()

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failing part is recorded, the others still run
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res.setdefault("seconds", {})[name] = time.perf_counter() - t0
        (out / "bench_vision.json").write_text(json.dumps(res, indent=2, default=str))
        say(f"{name}: {json.dumps(res[name], default=str)[:400]}")

    files = write_files(out, args.pair, args.images)
    res["files"] = {k: str(v) if isinstance(v, Path) else v for k, v in files.items()
                    if k not in ("images", "pixels")}
    step("ours", lambda: ours(files, args.images, args.n_ctx))
    if args.bin:
        step("mtmd_cli", lambda: mtmd_cli(Path(args.bin) / "llama-mtmd-cli", files, args.images, args.n_ctx))
    else:
        res["mtmd_cli"] = {"skipped": "no --bin (or $BIN): llama-mtmd-cli not run"}
    report(res, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
