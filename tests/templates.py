"""Chat templates of the shapes thinking models ship, written for the tests (the same variables and
tags as the real ones, not their text): a Qwen3-like template with an `enable_thinking` switch and
tools, one that opens the reasoning block in the generation prompt (DeepSeek-R1 style), and a
harmony-like one (gpt-oss's channels)."""

#: Qwen3's shape: tools listed in the system turn with the <tool_call> format, <think> in the
#: generation prompt only when thinking is switched off (an empty block).
QWEN3 = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "Tools you may call, one <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> per call:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")

#: DeepSeek-R1's shape: the generation prompt opens the block, the model writes reasoning, </think>, answer.
R1 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")

#: gpt-oss's shape: the model writes <|channel|>analysis<|message|>...<|end|> then the final channel.
HARMONY = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
           "{% for m in messages %}{% if m.role == 'assistant' %}"
           "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
           "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

#: Where each template's generation prompt ends (the fake model writes after the last one).
GEN_MARK = {"qwen3": b"<|im_start|>assistant\n", "r1": b"<|im_start|>assistant\n", "harmony": b"<|start|>assistant",
            "chatml": b"<|im_start|>assistant\n"}
BY_NAME = {"qwen3": QWEN3, "r1": R1, "harmony": HARMONY}
