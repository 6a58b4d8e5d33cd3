"""Writes the example workflows in both of ComfyUI's formats from one description.

    python examples/build_examples.py

`<name>.json` is the editor's format: ComfyUI lists it in its Templates browser (with `<name>.jpg`
as its thumbnail), or drag it onto the canvas. `api/<name>.api.json` is the API format that
POST /prompt takes; it lives one folder down because ComfyUI lists every .json of `examples/` as a
template and cannot open an API-format file there. Widget order for the A3B nodes comes from the
node declarations, so the files follow the nodes when they change.

Layout: nodes stand in columns, each at least as large as the editor draws its widgets (`min_size`,
from ComfyUI's frontend: LiteGraph's computeSize), with a gap between them, so a workflow opens
with nothing covered; the saved view (`frame`) shows every node in a 1600 x 900 window, below the
menu bar, beside the sidebar's icons and clear of the minimap.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
API = HERE / "api"

# Widgets of the ComfyUI core nodes the examples use, in their order.
CORE_WIDGETS = {
    "LoadImage": ["image"],
    "PrimitiveStringMultiline": ["value"],
    "StringConcatenate": ["string_a", "string_b", "delimiter"],
    "PreviewAny": [],
}
CORE_OUTPUTS = {
    "LoadImage": [("IMAGE", "IMAGE"), ("MASK", "MASK")],
    "PrimitiveStringMultiline": [("STRING", "STRING")],
    "StringConcatenate": [("STRING", "STRING")],
    "PreviewAny": [],
}
CORE_LINK_INPUTS = {"PreviewAny": [("source", "*")]}
#: core nodes' multiline text boxes: PrimitiveStringMultiline's value, PreviewAny's preview, StringConcatenate's strings
CORE_TEXT_BOXES = {"PrimitiveStringMultiline": 1, "PreviewAny": 1, "StringConcatenate": 2}

# The editor's measures (ComfyUI frontend 1.27, LiteGraph's LGraphNode.computeSize): the title bar
# (NODE_TITLE_HEIGHT) is drawn above a node's position; its body has a row per input or output slot
# (NODE_SLOT_HEIGHT), then each widget (NODE_WIDGET_HEIGHT, a multiline text box at least 50) with 4
# between widgets, 8 after them and 6 at the bottom; a node with a text box is at least 400 wide
# (the multiline widget's minNodeSize).
TITLE_H, SLOT_H, WIDGET_H, TEXT_BOX_H, WIDGET_GAP, BOTTOM = 30, 20, 20, 50, 4, 8 + 6
TEXT_BOX_MIN_W = 400
#: A3BGenerate's output widget (web/a3b.js outputMinHeight): ten 16 px lines of answer and a padding
ANSWER_BOX_H = 10 * 16 + 32

# The view is saved for the canvas of a 1600 x 900 browser window (frontend 1.27: a 1600 x 757 page, the
# workflow tabs and the menu bar take its top 78 px, the sidebar's icons its left 64 px, leaving a
# 1536 x 679 canvas), with a margin inside; the minimap covers the canvas's bottom right corner
# (250 x 200, 44 px from the right and 66 from the bottom), counted here up to the edges.
CANVAS = (1536, 679)
MARGIN = 16
MINIMAP = (300, 270)   # width and height of the corner it covers, counted from the bottom right
#: the space between two nodes of a column, and between columns
GAP = 40


def _a3b():
    from comfyui_a3b.nodes.defs import BY_ID

    return BY_ID


@dataclass
class N:
    id: int
    type: str
    title: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    links: dict[str, tuple[int, int]] = field(default_factory=dict)  # input -> (node id, output slot)
    pos: tuple[int, int] = (0, 0)
    size: tuple[int, int] = (320, 0)   # width, and the extra height for text boxes beyond their minimum


def _schema(t: str):
    """(widgets [(name, type, default, control)], link-only inputs [(name, type)], outputs [(name, type)])."""
    by_id = _a3b()
    if t in by_id:
        d = by_id[t]
        widgets = [(i.name, i.type, d.defaults().get(i.name), i.control_after_generate)
                   for i in d.inputs if i.is_widget]
        links = [(i.name, i.type) for i in d.inputs if not i.is_widget]
        outs = [(o.name, o.type) for o in d.outputs]
        return widgets, links, outs
    return ([(w, "STRING", "", False) for w in CORE_WIDGETS[t]], CORE_LINK_INPUTS.get(t, []), CORE_OUTPUTS[t])


def advanced_set(n: N) -> bool:
    """Whether a node's advanced inputs hold a value of their own: then it is saved with them shown."""
    d = _a3b().get(n.type)
    return d is not None and any(i.advanced and i.name in n.values and n.values[i.name] != d.defaults().get(i.name)
                                 for i in d.inputs)


def min_size(node_type: str, show_advanced: bool = False) -> tuple[int, int]:
    """The smallest (width, height) the editor draws a node of `node_type` in, title bar left out (see
    the measures above). A3BGenerate has its output widget below the inputs (web/a3b.js); inputs
    marked advanced count only when they are shown."""
    widgets, link_inputs, outs = _schema(node_type)
    d = _a3b().get(node_type)
    extra = 0
    if d is not None:
        hidden = set() if show_advanced else {i.name for i in d.inputs if i.advanced}
        boxes = sum(1 for i in d.inputs if i.is_widget and i.multiline and i.name not in hidden)
        widgets = [w for w in widgets if w[0] not in hidden]
        if node_type == "A3BGenerate":   # the output widget: counted as a box of its own height
            extra = ANSWER_BOX_H + WIDGET_GAP
    else:
        boxes = CORE_TEXT_BOXES.get(node_type, 0)
    n_widgets = len(widgets) + sum(1 for *_, control in widgets if control)   # control_after_generate adds one
    rows = max(len(link_inputs), len(outs), 1)
    height = (rows * SLOT_H + (n_widgets - boxes) * (WIDGET_H + WIDGET_GAP) + boxes * (TEXT_BOX_H + WIDGET_GAP)
              + extra + BOTTOM)
    return (TEXT_BOX_MIN_W if boxes or extra else 0), height


def arrange(columns: list[list[N]]) -> list[N]:
    """Place `columns` of nodes left to right, each node below the last one's bottom, every node at
    least `min_size` (plus the extra height its size asks for), and return the nodes in id order."""
    x = 0
    for column in columns:
        y = 0
        for n in column:
            w, h = min_size(n.type, advanced_set(n))
            n.size = (max(n.size[0], w), h + n.size[1])
            n.pos = (x, y)
            y += n.size[1] + TITLE_H + GAP
        x += max(n.size[0] for n in column) + GAP
    return sorted((n for column in columns for n in column), key=lambda n: n.id)


def build(nodes: list[N]) -> tuple[dict, dict]:
    links: list[list] = []
    ui_nodes = []
    api: dict[str, dict] = {}
    out_links: dict[tuple[int, int], list[int]] = {}
    for n in nodes:
        for name, (src, slot) in n.links.items():
            lid = len(links) + 1
            src_type = _schema(next(x.type for x in nodes if x.id == src))[2][slot][1]
            links.append([lid, src, slot, n.id, name, src_type])
            out_links.setdefault((src, slot), []).append(lid)
    for order, n in enumerate(nodes):
        widgets, link_inputs, outs = _schema(n.type)
        inputs, wvals = [], []
        api_inputs: dict[str, Any] = {}
        link_by_name = {lk[4]: lk for lk in links if lk[3] == n.id}
        for name, typ in link_inputs:
            lk = link_by_name.get(name)
            inputs.append({"name": name, "type": typ, "link": lk[0] if lk else None})
            if lk:
                api_inputs[name] = [str(lk[1]), lk[2]]
        for name, typ, default, control in widgets:
            value = n.values.get(name, default)
            wvals.append(value)
            if control:
                wvals.append("fixed")  # control_after_generate: keep the seed, so a re-run hits the cache
            lk = link_by_name.get(name)
            if lk:
                inputs.append({"name": name, "type": typ if typ != "COMBO" else "COMBO", "widget": {"name": name},
                               "link": lk[0]})
                api_inputs[name] = [str(lk[1]), lk[2]]
            else:
                api_inputs[name] = value
        ui_nodes.append({
            "id": n.id, "type": n.type, "pos": list(n.pos), "size": list(n.size), "flags": {}, "order": order,
            "mode": 0, "inputs": inputs,
            "outputs": [{"name": name, "type": typ, "links": out_links.get((n.id, slot), []), "slot_index": slot}
                        for slot, (name, typ) in enumerate(outs)],
            "properties": {"Node name for S&R": n.type}, "widgets_values": wvals,
            **({"title": n.title} if n.title else {}), **({"showAdvanced": True} if advanced_set(n) else {}),
        })
        api[str(n.id)] = {"class_type": n.type, "inputs": api_inputs,
                          **({"_meta": {"title": n.title}} if n.title else {})}
    for lk in links:  # the editor's link rows use the input slot index, not its name
        target = next(u for u in ui_nodes if u["id"] == lk[3])
        lk[4] = next(i for i, x in enumerate(target["inputs"]) if x["name"] == lk[4])
    ui = {"last_node_id": max(n.id for n in nodes), "last_link_id": len(links), "nodes": ui_nodes,
          "links": links, "groups": [], "config": {}, "extra": {"ds": frame(nodes)}, "version": 0.4}
    return ui, api


def screen_boxes(nodes: list[N], ds: dict) -> list[tuple[float, float, float, float]]:
    """Each node's box (title bar included) in the canvas's pixels under the view `ds` (LiteGraph's
    DragAndScale: pixel = (graph position + offset) * scale)."""
    s, (ox, oy) = ds["scale"], ds["offset"]
    return [((n.pos[0] + ox) * s, (n.pos[1] - TITLE_H + oy) * s, (n.pos[0] + n.size[0] + ox) * s,
             (n.pos[1] + n.size[1] + oy) * s) for n in nodes]


def visible(box: tuple[float, float, float, float]) -> bool:
    """Whether a box on the canvas (in its pixels) lies in the part of it nothing covers (see CANVAS)."""
    x0, y0, x1, y1 = box
    inside = x0 >= 0 and y0 >= 0 and x1 <= CANVAS[0] and y1 <= CANVAS[1]
    under_minimap = x1 > CANVAS[0] - MINIMAP[0] and y1 > CANVAS[1] - MINIMAP[1]
    return inside and not under_minimap


def frame(nodes: list[N]) -> dict:
    """The saved view: the largest scale (at most 1) at which every node, title bar included, lies in the
    uncovered part of the canvas of a 1600 x 900 window, the graph's top left corner a margin inside it."""
    x0 = min(n.pos[0] for n in nodes)
    y0 = min(n.pos[1] - TITLE_H for n in nodes)
    scale = 1.0
    while scale > 0.1:
        left, top = MARGIN, MARGIN
        ds = {"scale": round(scale, 3), "offset": [round(left / scale - x0, 1), round(top / scale - y0, 1)]}
        if all(visible(b) for b in screen_boxes(nodes, ds)):
            return ds
        scale -= 0.01
    raise ValueError("the workflow does not fit the window at any scale")


# -- the examples ------------------------------------------------------------------------------------------
PREMISE = ("A small cheerful robot named Bolt washes up on the rocks below an old lighthouse. "
           "Mira, the gruff lighthouse keeper, finds it during a storm.")


def comic_script() -> list[N]:
    gen = dict(max_new_tokens=200, temperature=0.7, seed=42)
    text = (380, 0)   # generate nodes: the answer box shows its ten lines
    return arrange([
        [N(1, "A3BLoader"),
         N(2, "PrimitiveStringMultiline", "Premise", {"value": PREMISE}, size=(320, 80))],
        [N(3, "A3BGenerate", "Storyboard", {
            **gen, "system": "You are a comic book writer. Be brief and visual.",
            "prompt": ("Write a storyboard of exactly 3 comic panels for this premise. One line per panel, "
                       "starting with 'Panel 1:', 'Panel 2:' and 'Panel 3:'."),
        }, links={"model": (1, 0), "context": (2, 0)}, size=text),
         N(6, "A3BGenerate", "Image prompt, panel 1", {
             **gen, "max_new_tokens": 48, "temperature": 0.4,
             "system": "You write prompts for an image model: one line of comma-separated visual keywords.",
             "prompt": "Write the image prompt for Panel 1.",
         }, links={"model": (1, 0), "context": (3, 0)}, size=text)],
        [N(4, "A3BGenerate", "Mira's dialogue", {
            **gen, "max_new_tokens": 120,
            "system": "You are Mira, an old lighthouse keeper: gruff but kind, you speak in short sentences.",
            "prompt": "Write Mira's line of dialogue for each panel, as 'Panel N: \"...\"'.",
        }, links={"model": (1, 0), "context": (3, 0)}, size=text),
         N(5, "A3BGenerate", "Bolt's dialogue", {
             **gen, "max_new_tokens": 120,
             "system": "You are Bolt, a small cheerful robot who loves asking questions.",
             "prompt": "Write Bolt's line of dialogue for each panel, as 'Panel N: \"...\"'.",
         }, links={"model": (1, 0), "context": (3, 0)}, size=text)],
        [N(10, "StringConcatenate", "Mira's lines, labelled", {"string_a": "--- Mira ---", "delimiter": "\n"},
           links={"string_b": (4, 0)}, size=(300, 0)),
         N(7, "StringConcatenate", "Dialogue", {"delimiter": "\n\n--- Bolt ---\n"},
           links={"string_a": (10, 0), "string_b": (5, 0)}, size=(300, 0))],
        [N(8, "PreviewAny", "Script", links={"source": (7, 0)}, size=(360, 320)),
         N(9, "PreviewAny", "Image prompt (connect to a text encoder)", links={"source": (6, 0)}, size=(360, 120))],
    ])


#: The storyboard as data: a JSON list of panels, which the answer must follow (llama.cpp's grammar)
PANELS_SCHEMA = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "required": ["panel", "scene", "dialogue"], "additionalProperties": False,
    "properties": {"panel": {"type": "integer", "minimum": 1, "maximum": 3},
                   "scene": {"type": "string", "maxLength": 160},
                   "dialogue": {"type": "string", "maxLength": 120}}}}


def storyboard_json() -> list[N]:
    """A storyboard as a JSON list of panels (json_schema), a thinking model's reasoning kept apart,
    and the panels read by the next step as data."""
    return arrange([
        [N(1, "A3BLoader"),
         N(2, "PrimitiveStringMultiline", "Premise", {"value": PREMISE}, size=(320, 80))],
        [N(3, "A3BGenerate", "Storyboard (JSON panels)", {
            "max_new_tokens": 360, "temperature": 0.3, "seed": 7, "thinking": "auto", "reasoning_budget": 256,
            "json_schema": json.dumps(PANELS_SCHEMA, indent=1),
            "system": "You are a comic book writer. Be brief and visual.",
            "prompt": "Write a storyboard of 3 comic panels for this premise: the scene and one line of dialogue each.",
        }, links={"model": (1, 0), "context": (2, 0)}, size=(400, 240))],
        [N(4, "A3BGenerate", "Image prompt, panel 1", {
            "max_new_tokens": 48, "temperature": 0.4, "seed": 7, "thinking": "off",
            "system": "You write prompts for an image model: one line of comma-separated visual keywords.",
            "prompt": "Write the image prompt for the scene of panel 1 of this JSON storyboard.",
        }, links={"model": (1, 0), "context": (3, 0)}, size=(380, 120))],
        [N(5, "PreviewAny", "Panels (JSON)", links={"source": (3, 0)}, size=(360, 240)),
         N(6, "PreviewAny", "Reasoning (thinking models)", links={"source": (3, 2)}, size=(360, 160)),
         N(7, "PreviewAny", "Image prompt (connect to a text encoder)", links={"source": (4, 0)}, size=(360, 120))],
    ])


DOCUMENTS = "\n".join([
    "The ferry to Harrow Island leaves the north pier every day at 7:15 in the morning.",
    "The town library is closed on Mondays and opens at nine on other days.",
    "Harrow Island has one bakery, famous for its rye bread with caraway seeds.",
    "The lighthouse on Gull Point was automated in 1987 and is no longer staffed.",
    "Tickets for the ferry cost 4 euros for adults and are sold on board.",
    "The annual kite festival takes place on the beach in the second week of August.",
    "Bicycles can be rented next to the bus station for 10 euros a day.",
    "The island's only doctor holds a clinic on Tuesdays and Fridays.",
])
QUESTION = "What time does the ferry to Harrow Island leave?"


def rag() -> list[N]:
    return arrange([
        [N(1, "A3BLoader"),
         N(2, "PrimitiveStringMultiline", "Documents (one per line)", {"value": DOCUMENTS}, size=(420, 200)),
         N(3, "PrimitiveStringMultiline", "Question", {"value": QUESTION}, size=(420, 40))],
        [N(4, "A3BEmbed", "Embed documents", links={"model": (1, 0), "text": (2, 0)}, size=(300, 0)),
         N(5, "A3BEmbed", "Embed question", links={"model": (1, 0), "text": (3, 0)}, size=(300, 0))],
        [N(6, "A3BTopK", "Retrieve", {"top_k": 2}, links={"documents": (4, 0), "texts": (4, 1), "query": (5, 0)},
           size=(320, 0)),
         N(8, "PreviewAny", "Retrieved", links={"source": (6, 1)}, size=(360, 200))],
        [N(7, "A3BGenerate", "Answer", {
            "max_new_tokens": 48, "temperature": 0.0, "seed": 1,
            "system": "Answer the question using only the notes above it. One short sentence.",
        }, links={"model": (1, 0), "context": (6, 0), "prompt": (3, 0)}, size=(380, 120))],
    ])


def image_dialogue() -> list[N]:
    """Image -> panel description -> dialogue: a vision-language model (a GGUF with its mmproj beside it
    in models/LLM, chosen in the loader) looks at a picture (ComfyUI's input/example.png), describes it
    as a comic panel, and the next step writes the characters' lines for that panel."""
    text = (380, 120)
    return arrange([
        [N(1, "A3BLoader", "Vision-language model (pick one with its mmproj)", size=(360, 0)),
         N(2, "LoadImage", "Panel image", {"image": "example.png"}, size=(320, 320))],
        [N(3, "A3BGenerate", "Panel description", {
            "max_new_tokens": 120, "temperature": 0.2, "seed": 3,
            "system": "You describe comic panels for a script writer: who is there, where, what happens. Be brief.",
            "prompt": "Describe this picture as one comic panel, in two or three sentences.",
        }, links={"model": (1, 0), "image": (2, 0)}, size=text)],
        [N(4, "A3BGenerate", "Dialogue", {
            "max_new_tokens": 96, "temperature": 0.7, "seed": 3,
            "system": "You are a comic book writer. Dialogue is short, one line per speaker.",
            "prompt": "Write the dialogue for this panel: two or three lines, as 'NAME: \"...\"'.",
        }, links={"model": (1, 0), "context": (3, 0)}, size=text)],
        [N(5, "PreviewAny", "Panel", links={"source": (3, 0)}, size=(360, 160)),
         N(6, "PreviewAny", "Dialogue", links={"source": (4, 0)}, size=(360, 160))],
    ])


EXAMPLES = {"comic_script": comic_script, "rag": rag, "storyboard_json": storyboard_json,
            "image_dialogue": image_dialogue}


def main() -> None:
    for name, fn in EXAMPLES.items():
        ui, api = build(fn())
        (HERE / f"{name}.json").write_text(json.dumps(ui, indent=1) + "\n")
        API.mkdir(exist_ok=True)
        (API / f"{name}.api.json").write_text(json.dumps(api, indent=1) + "\n")
        print(f"wrote examples/{name}.json and examples/api/{name}.api.json")


if __name__ == "__main__":
    main()
