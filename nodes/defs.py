"""The nodes, declared once as plain data plus a `run` function each. No ComfyUI import here.

`v3.py` turns these declarations into ComfyUI V3 nodes (`io.ComfyNode`), `v1.py` into V1 classes
(`INPUT_TYPES` dicts) for ComfyUI releases without the V3 API. Tests read the same declarations and
call the same `run` functions, so the node contract is checked where ComfyUI is not installed.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..prune.settings import GPU_RECOVERY, METHOD, RECOVER_STEPS
from ..runtime import options as opt
from ..runtime.errors import Cancelled
from . import comfy, core, embeddings, generation
from .schema import In, NodeDef, Out, widget
from . import router as noderouter
from . import images as nodeimages

#: the n_gpu_layers widget's "auto" (an INT widget cannot hold the runtime's "auto"): see `widget`
AUTO_GPU_LAYERS = opt.N_GPU_LAYERS.min - 1
#: the reasoning_budget widget's "no limit" (an INT widget cannot hold None): see `widget`
NO_BUDGET = opt.REASONING_BUDGET.min - 1

MODEL = "A3B_MODEL"           # a LoadSpec: a light handle, the runtime holds the weights
EMBEDDINGS = "EMBEDDINGS"     # a torch.Tensor, N x D float32


#: The A3B Prune node's widgets: the pruning declarations (prune/settings.py), where a ratio of 1 (the
#: default) means no pruning, the method list starts with the default, and recover_steps -1 leaves it unset.
KEEP_RATIO = replace(core.KEEP, name="keep_ratio", default=1.0,
                     help="A3B pruning: keep this share of FFN neurons (1.0 = off). Made once and cached; needs torch.")
HEADS_KEEP = replace(core.HEADS_KEEP, help=(
    "A3B head pruning: keep this share of the query heads of every KV group (1.0 = off; 0.67 keeps 2 of 3). "
    "llama and qwen3 models with grouped-query attention; needs torch."))
EXPERTS_KEEP = replace(core.EXPERTS_KEEP, help=(
    "A3B expert pruning of mixture-of-experts models (qwen3moe, qwen35moe): keep this share of the routed "
    "experts of every layer (1.0 = off), ranked by REAP on calibration text; one-shot (recover_steps 0 or -1). "
    "Made once and cached."))
PRUNE_METHOD = replace(METHOD, name="prune_method", choices=tuple(core.prune_methods()),
                       help="How neurons are ranked when keep_ratio < 1.")
RECOVER_STEPS_WIDGET = replace(RECOVER_STEPS.or_none(), max=10_000, help=(
    "Distillation steps after pruning when keep_ratio < 1 (0 = none; -1 = the default for where it runs: "
    f"{RECOVER_STEPS.default} steps of 8 x 128 tokens on the CPU, about 8 s each for a 135M model on 2 cores; "
    f"{GPU_RECOVERY['recover_steps']} steps of 32 x 512 on a CUDA GPU, about 8 minutes on an H200). Made once, then "
    "cached. Expert pruning (experts_keep < 1) and mixture-of-experts models are one-shot: -1 means 0 there, and "
    "a count above 0 with experts_keep < 1 is refused."))


def _first(x: Any) -> Any:
    """With list inputs every argument arrives as a list; scalars are its first item."""
    return x[0] if isinstance(x, list) and x else x


# -- A3BLoader, A3BPrune ---------------------------------------------------------------------
def _run_loader(node_id, *, model, n_ctx, n_gpu_layers, mmproj="auto", lora=core.NONE_CHOICE, lora_strength=None,
                threads=0, flash_attn=opt.FLASH_ATTN.default, kv_cache_type=opt.KV_CACHE_TYPE.default,
                serve_as=opt.SERVE_AS_OPTION.default, speculative=None, draft_max=None, cpu_moe=False, n_cpu_moe=0,
                override_tensor="", backend_sampling=None):
    comfy.register_model_folders()
    spec = core.load_model(model, n_ctx=n_ctx, n_threads=threads, mmproj=nodeimages.resolve_mmproj(mmproj),
                           n_gpu_layers="auto" if n_gpu_layers == AUTO_GPU_LAYERS else n_gpu_layers,
                           flash_attn=flash_attn, kv_cache_type=kv_cache_type, lora=lora,
                           lora_strength=lora_strength, serve_as=serve_as,
                           speculative=speculative or None, draft_max=draft_max, cpu_moe=bool(cpu_moe),
                           n_cpu_moe=int(n_cpu_moe or 0), override_tensor=(override_tensor or "").strip() or None,
                           backend_sampling=backend_sampling or None,
                           lora_folders=comfy.lora_folders(), free_vram=comfy.free_vram,
                           vram_reserve=comfy.inference_reserve)
    return (spec,), {"text": [core.describe(spec)]}


def _fingerprint_loader(*, model, lora=core.NONE_CHOICE, mmproj="auto", **_):
    return core.model_fingerprint(model, lora, 1.0, comfy.lora_folders(), mmproj)


def _mmproj_options() -> list[str]:
    comfy.register_model_folders()
    return nodeimages.mmproj_choices()


def _model_options() -> list[str]:
    comfy.register_model_folders()
    return core.model_choices()


def _advanced(i: In, optional: bool = True) -> In:
    """`i` shown only after the node's "Show Advanced" (a loader input is optional too: its default
    applies when a workflow leaves it out)."""
    i.advanced = True
    i.optional = i.optional or optional
    return i


LOADER = NodeDef(
    node_id="A3BLoader", display_name="A3B Loader",
    description=("Loads a GGUF model from models/LLM (or the embedded SmolLM2-135M default) into the "
                 "shared runtime and outputs a handle. Cached: running it again does not reload. Threads, KV "
                 "cache, expert placement and drafting are advanced inputs (right-click the node: Show Advanced); "
                 "pruning is the A3B Prune node."),
    inputs=[
        In("model", "COMBO", options=_model_options, default=core.DEFAULT_CHOICE,
           tooltip="A .gguf file in ComfyUI's models/LLM folder, or the embedded default."),
        widget(opt.N_CTX),
        widget(opt.N_GPU_LAYERS, note=f"Here {AUTO_GPU_LAYERS} stands for auto; ComfyUI is asked to make room first."),
        In("mmproj", "COMBO", "auto", optional=True, options=_mmproj_options,
           tooltip=opt.MMPROJ.help + " The files listed are the mmproj*.gguf found in models/LLM."),
        In("lora", "COMBO", core.NONE_CHOICE, optional=True,
           options=lambda: core.lora_choices(comfy.lora_folders()),
           tooltip="A GGUF LoRA adapter (models/LLM/loras) applied over the model."),
        widget(opt.LORA_SCALE, "lora_strength", optional=True),
        _advanced(widget(opt.N_THREADS, "threads")),
        _advanced(widget(opt.FLASH_ATTN)),
        _advanced(widget(opt.KV_CACHE_TYPE)),
        _advanced(widget(opt.SERVE_AS_OPTION)),
        _advanced(widget(opt.SPECULATIVE)),
        _advanced(widget(opt.DRAFT_MAX)),
        _advanced(widget(opt.CPU_MOE)),
        _advanced(widget(opt.N_CPU_MOE)),
        _advanced(widget(opt.OVERRIDE_TENSOR)),
        _advanced(widget(opt.BACKEND_SAMPLING)),
    ],
    outputs=[Out("model", MODEL, "Handle of the loaded model; the runtime reloads it on demand.")],
    run=_run_loader, fingerprint=_fingerprint_loader,
)


def _run_prune(node_id, *, model, keep_ratio, prune_method, recover_steps, heads_keep, experts_keep):
    spec = core.prune_model(model, keep_ratio=keep_ratio, prune_method=prune_method, recover_steps=recover_steps,
                            heads_keep=heads_keep, experts_keep=experts_keep)
    return (spec,), {"text": [core.describe(spec)]}


def _fingerprint_prune(*, model, keep_ratio, prune_method, recover_steps, heads_keep, experts_keep, **_):
    path = getattr(model, "path", None)
    return core.model_fingerprint(path or "", None, keep_ratio, (), prune_method, recover_steps, heads_keep,
                                  experts_keep) if path else None


PRUNE = NodeDef(
    node_id="A3BPrune", display_name="A3B Prune",
    description=("A3B pruning of a loaded model: keeps a share of the FFN neurons (and of the query heads, or of "
                 "a mixture-of-experts model's experts), optionally recovered by distillation, and outputs the "
                 "pruned model. Made once and cached on disk; needs torch (the prune extra)."),
    inputs=[
        In("model", MODEL, tooltip="The model to prune (from A3B Loader); its loading settings carry over."),
        widget(KEEP_RATIO),
        widget(PRUNE_METHOD),
        widget(RECOVER_STEPS_WIDGET, none_below=True),
        widget(HEADS_KEEP),
        widget(EXPERTS_KEEP),
    ],
    outputs=[Out("model", MODEL, "Handle of the pruned model (the input unchanged when every ratio is 1.0).")],
    run=_run_prune, fingerprint=_fingerprint_prune,
)


# -- A3BRouter -------------------------------------------------------------------------------------------------
def _run_router(node_id, *, default, code, route_embedding=opt.ROUTE_EMBEDDING.default):
    handle = noderouter.routed_model(default, code, route_embedding)
    return (handle,), {"text": [f"default: {core.describe(default)}\ncode: {core.describe(code)}"]}


ROUTER = NodeDef(
    node_id="A3BRouter", display_name="A3B Router",
    description=("One model handle over two loaded models: A3B Generate sends each prompt to the model its task "
                 "needs (code, algorithms and maths to code, the rest to default), decided by code signs and "
                 "example prompts in a fraction of a millisecond. The route taken is shown in the node."),
    inputs=[
        In("default", MODEL, tooltip="The model for general prompts (and for A3B Embed)."),
        In("code", MODEL, tooltip="The model for code, algorithms and maths."),
        _advanced(widget(opt.ROUTE_EMBEDDING)),
    ],
    outputs=[Out("model", MODEL, "A handle that routes each prompt to one of the two models.")],
    run=_run_router,
)


# -- A3BGenerate ------------------------------------------------------------------------------------------
def _run_generate(node_id, *, image=None, image_mode=nodeimages.ALL_IN_ONE, **inputs):
    parts = nodeimages.tensor_images(image) if image is not None else []
    if image_mode == nodeimages.ONE_EACH and len(parts) > 1:   # one answer per image, one after another
        outs = [_generate_one(node_id, [p], **inputs)[0] for p in parts]
        text = "\n\n".join(o[0] for o in outs)
        spans = "[" + ", ".join(o[1] for o in outs) + "]"
        return (text, spans, "\n\n".join(o[2] for o in outs)), {"text": [text]}
    return _generate_one(node_id, parts, **inputs)


def _generate_one(node_id, images, *, model, prompt, system, max_new_tokens, temperature, top_p, top_k, min_p,
                  repeat_penalty, seed, stop, confidence_aware, confidence_threshold, context=None,
                  thinking=opt.THINKING.default, reasoning_budget=NO_BUDGET, json_schema=""):
    bar = comfy.progress_bar(max_new_tokens, node_id)
    comfy.send(comfy.EVENT_TOKEN, {"node": node_id, "text": "", "reset": True})

    def on_text(text: str, n: int) -> None:
        bar(n)
        if text:
            comfy.send(comfy.EVENT_TOKEN, {"node": node_id, "text": text, "n": n})

    def on_reasoning(text: str, n: int) -> None:
        comfy.send(comfy.EVENT_TOKEN, {"node": node_id, "reasoning": text, "n": n})

    hooks = generation.GenerateHooks(on_text=on_text, should_stop=comfy.interrupted, on_reasoning=on_reasoning)
    try:
        sampling = generation.sampling_params(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                        repeat_penalty=repeat_penalty, seed=seed)
        g = generation.generate(model, prompt, system=system, context=context, max_new_tokens=max_new_tokens,
                          sampling=sampling, stop=stop,
                          confidence_aware=confidence_aware, confidence_threshold=confidence_threshold,
                          hooks=hooks, thinking=thinking,
                          reasoning_budget=None if reasoning_budget == NO_BUDGET else reasoning_budget,
                          json_schema=json_schema, images=images)
    except Cancelled:
        comfy.send(comfy.EVENT_DONE, {"node": node_id, "interrupted": True})
        comfy.raise_interrupted()  # ComfyUI reports "interrupted" rather than an error
        raise
    except Exception as e:  # ComfyUI's progress hook raises its own exception on Cancel
        comfy.send(comfy.EVENT_DONE, {"node": node_id, "interrupted": comfy.is_interrupt(e), "error": str(e)})
        raise
    r = g.result
    comfy.send(comfy.EVENT_DONE, {"node": node_id, "n_tokens": r.n_tokens, "finish_reason": r.finish_reason,
                                  "tokens_per_second": r.tokens_per_second,
                                  "time_to_first_token": r.time_to_first_token,
                                  "n_prompt_tokens": r.n_prompt_tokens,
                                  "n_cached_prompt_tokens": r.n_cached_prompt_tokens,
                                  "n_reasoning_tokens": r.n_reasoning_tokens, **({"note": g.note} if g.note else {}),
                                  **({"route": g.ui["route"][0]} if "route" in g.ui else {})})
    return (g.text, g.spans_json, g.reasoning), g.ui


GENERATE = NodeDef(
    node_id="A3BGenerate", display_name="A3B Generate",
    description=("Chat generation on the shared model. Tokens stream into the node while they are "
                 "generated; Cancel stops between two tokens. Same inputs and seed: cached."),
    inputs=[
        In("model", MODEL),
        In("prompt", "STRING", "", multiline=True, tooltip="What to answer. A connected context goes before it."),
        In("system", "STRING", "", multiline=True, tooltip="System prompt (a character, a style, rules)."),
        widget(opt.MAX_TOKENS, "max_new_tokens", note="The answer ends earlier where n_ctx is full (a note says so)."),
        widget(opt.TEMPERATURE, round=0.01),
        _advanced(widget(opt.TOP_P, round=0.01), optional=False),
        _advanced(widget(opt.TOP_K), optional=False),
        _advanced(widget(opt.MIN_P, round=0.01), optional=False),
        _advanced(widget(opt.REPEAT_PENALTY, round=0.01), optional=False),
        widget(opt.SEED, control_after_generate=True),
        _advanced(In("stop", "STRING", "", multiline=True,
                     tooltip="Stop strings, one per line (\\n for a newline)."), optional=False),
        _advanced(In("confidence_aware", "BOOLEAN", False,
                     tooltip="Watch the model's entropy; mark runs of uncertain tokens and output them as spans."),
                  optional=False),
        _advanced(widget(opt.THRESHOLD, "confidence_threshold", optional=True, round=0.01)),
        In("context", "STRING", optional=True, force_input=True,
           tooltip="Text placed before the prompt: a storyboard, retrieved passages."),
        widget(opt.THINKING, optional=True, note="The reasoning goes to its own output."),
        widget(opt.REASONING_BUDGET, optional=True, none_below=True,
               note=f"Here {NO_BUDGET} = what the context holds beyond the prompt and max_new_tokens, so an answer "
                    "always has room; max_new_tokens counts the answer."),
        _advanced(widget(opt.JSON_SCHEMA, optional=True, multiline=True,
               note="Paste a schema (empty = free text); the text output is then JSON, e.g. a storyboard as a list "
                    "of panels.")),
        In("image", "IMAGE", optional=True,
           tooltip="Images the model looks at before the prompt (needs the model's projector: A3BLoader's mmproj)."),
        _advanced(In("image_mode", "COMBO", nodeimages.ALL_IN_ONE, optional=True, options=list(nodeimages.IMAGE_MODES),
                     tooltip="A batch of images: all in one prompt, or one request per image (the answers one "
                             "after another, a blank line between; the spans output a list per image).")),
    ],
    outputs=[Out("text", "STRING", "The answer (without the reasoning of a thinking model)."),
             Out("low_confidence_spans", "STRING", "JSON list of low-confidence spans (start, end, text, entropy)."),
             Out("reasoning", "STRING", "What a thinking model reasoned before its answer (empty for others).")],
    run=_run_generate, output_node=True,
)


# -- A3BEmbed -------------------------------------------------------------------------------------------
def _run_embed(node_id, *, model, text, pooling, normalize):
    model, pooling, normalize = _first(model), _first(pooling), _first(normalize)
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
        text = text[0]  # the widget, or one connected string: one item per line
    vecs, texts = embeddings.embed(model, text, pooling=pooling, normalize=normalize)
    return (embeddings.to_tensor(vecs), texts), {"text": [f"{len(texts)} x {vecs.shape[1]} embeddings ({pooling})"]}


EMBED = NodeDef(
    node_id="A3BEmbed", display_name="A3B Embed",
    description=("Embeddings from the same loaded weights: one item per line, or a connected list of "
                 "texts. Outputs an N x D tensor and the texts, for retrieval."),
    inputs=[
        In("model", MODEL),
        In("text", "STRING", "", multiline=True, tooltip="One item per line (or connect a list of STRING)."),
        widget(opt.POOLING),
        widget(opt.NORMALIZE),
    ],
    outputs=[Out("embeddings", EMBEDDINGS, "torch.Tensor, N x D float32"),
             Out("texts", "STRING", "The N texts, in the order of the rows.", is_list=True)],
    run=_run_embed, input_is_list=True,
)


# -- A3BTopK ---------------------------------------------------------------------------------------------
def _run_topk(node_id, *, documents, texts, query, top_k, separator):
    documents, query, top_k, separator = _first(documents), _first(query), _first(top_k), _first(separator)
    texts = list(texts or [])
    idx, scores = embeddings.top_k(documents, texts, query, int(top_k))
    sep = separator.replace("\\n", "\n").replace("\\t", "\t")
    context = sep.join(texts[i] for i in idx)
    report = "\n".join(f"{s:.3f}  {texts[i]}" for i, s in zip(idx, scores))
    return (context, report), {"text": [report]}


TOPK = NodeDef(
    node_id="A3BTopK", display_name="A3B Top-K Similarity",
    description="Retrieves the documents closest to a query by cosine similarity (no other pack needed).",
    inputs=[
        In("documents", EMBEDDINGS, tooltip="Embeddings of the documents (A3BEmbed)."),
        In("texts", "STRING", force_input=True, tooltip="The texts output of the same A3BEmbed node."),
        In("query", EMBEDDINGS, tooltip="Embedding of the question (its first row is used)."),
        In("top_k", "INT", 3, min=1, max=100),
        In("separator", "STRING", "\\n\\n", tooltip="Put between retrieved texts (\\n for a newline)."),
    ],
    outputs=[Out("context", "STRING", "The top-k texts, best first."),
             Out("scores", "STRING", "One line per hit: similarity and text.")],
    run=_run_topk, input_is_list=True,
)


# -- A3BUnload ----------------------------------------------------------------------------------------------
def _run_unload(node_id, *, model=None, passthrough=None, unload_all):
    n = core.unload(None if unload_all or model is None else model)
    return (passthrough if passthrough is not None else "",), {"text": [f"unloaded {n} model context(s)"]}


def _fingerprint_always(**_):
    return float("nan")  # never equal to itself: runs every time it is queued


UNLOAD = NodeDef(
    node_id="A3BUnload", display_name="A3B Unload",
    description=("Frees the connected model now (every model when none is connected). Handles stay valid: "
                 "the next node that needs the model loads it again. ComfyUI's Unload models button does the "
                 "same for all."),
    inputs=[
        In("model", MODEL, optional=True),
        In("passthrough", "STRING", optional=True, force_input=True,
           tooltip="Connect a text to unload after it is made; it is passed on unchanged."),
        In("unload_all", "BOOLEAN", False, optional=True),
    ],
    outputs=[Out("passthrough", "STRING")],
    run=_run_unload, fingerprint=_fingerprint_always, output_node=True, not_idempotent=True,
)

NODES: list[NodeDef] = [LOADER, PRUNE, ROUTER, GENERATE, EMBED, TOPK, UNLOAD]
BY_ID = {n.node_id: n for n in NODES}
