"""Real tokenizers for Strata's synthetic GGUF models (random weights, real shapes).

    vocab = synthetic_vocab("qwen", 151936)   # or ("mistral", 32000)
    vocab.add_to(writer)                      # writes every tokenizer.* key

Merges are learned with the `tokenizers` BPE trainer on corpus.py, which is fixed text, so the
result is the same on every call. The vocabulary is then padded with unused "[PAD{i}]" tokens
(type 5, as llama.cpp's converter writes them) to exactly n_vocab, the model's embedding rows.

    qwen     byte-level BPE, pre "qwen2"; <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos) are
             control tokens and <think>, </think> user-defined ones, as in Qwen3's own GGUF files;
             no BOS; a Qwen3-style ChatML template that honours enable_thinking.
    mistral  SentencePiece BPE ("llama"): <unk>, <s> (bos), </s> (eos), <0x00>..<0xFF>, then
             "▁"-pieces scored by merge order; BOS added; a Mistral [INST] template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import gguf
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from strata.tokenizer.bpe import PRE_TOKENIZERS, byte_alphabet
from strata.tokenizer.corpus import CORPUS
from strata.tokenizer.spm import SPACE
from strata.tokenizer.vocab import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

QWEN_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role == 'system' or message.role == 'user' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# gpt-oss's harmony format, in the shape of its own template: a system message that states the
# reasoning effort (reasoning_effort, default medium), the request's system message as the
# developer's instructions, past assistant turns on the final channel (their reasoning, where
# given, on the analysis channel of the last one), tool results from functions.NAME
HARMONY_TEMPLATE = """\
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort
    else 'medium' %}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n' }}
{{- 'Knowledge cutoff: 2024-06\\n\\nReasoning: ' + effort + '\\n\\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every '
    'message.<|end|>' }}
{%- for message in messages %}
    {%- if message.role == 'system' or message.role == 'developer' %}
        {{- '<|start|>developer<|message|># Instructions\\n\\n' + message.content + '<|end|>' }}
    {%- elif message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- set thinking = message.thinking or message.reasoning_content %}
        {%- if thinking and loop.last %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' }}
        {%- endif %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + (message.content or '')
            + '<|end|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start|>functions.' + (message.name or 'tool') + ' to=assistant<|channel|>'
            'commentary<|message|>' + message.content + '<|end|>' }}
    {%- else %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""

MISTRAL_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system = '' %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in turns %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {%- if message.role == 'user' %}
        {%- set text = system + '\\n\\n' + message.content if loop.first and system
                       else message.content %}
        {{- '[INST] ' + text + ' [/INST]' }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content + eos_token }}
    {%- else %}
        {{- raise_exception('Only system, user and assistant roles are supported') }}
    {%- endif %}
{%- endfor %}
"""


@dataclass(frozen=True)
class SyntheticVocab:
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float] | None
    bos_id: int | None
    eos_id: int
    eot_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        """Write every tokenizer.* key of this vocabulary."""
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        if self.merges:
            writer.add_token_merges(self.merges)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.bos_id is not None:
            writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        for token_id, add in ((self.eot_id, writer.add_eot_token_id),
                              (self.pad_id, writer.add_pad_token_id)):  # fmt: skip
            if token_id is not None:
                add(token_id)
        if UNKNOWN in self.token_types:
            writer.add_unk_token_id(self.token_types.index(UNKNOWN))
        if self.model == "llama":
            writer.add_add_space_prefix(True)
        writer.add_add_bos_token(self.add_bos)
        writer.add_chat_template(self.chat_template)


def synthetic_vocab(kind: str, n_vocab: int) -> SyntheticVocab:
    """A deterministic vocabulary of exactly n_vocab tokens; kind is "qwen" or "mistral"."""
    if kind == "qwen":
        return _qwen(n_vocab)
    if kind == "mistral":
        return _mistral(n_vocab)
    if kind == "harmony":
        return _harmony(n_vocab)
    raise ValueError(f"unknown synthetic vocabulary kind {kind!r} (known: qwen, mistral, "
                     "harmony)")


def _learn_merges(pre: pre_tokenizers.PreTokenizer, alphabet: list[str], texts: list[str],
                  limit: int) -> list[tuple[str, str]]:  # fmt: skip
    """Up to `limit` BPE merges learned from `texts`, most frequent first."""
    if limit <= 0:
        return []
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + limit, min_frequency=1, initial_alphabet=alphabet,
        limit_alphabet=len(alphabet), show_progress=False,
    )  # fmt: skip
    backend.train_from_iterator(texts, trainer)
    return [tuple(pair) for pair in json.loads(backend.to_str())["model"]["merges"]][:limit]


def _pad(tokens: list[str], types: list[int], n_vocab: int, base: int, kind: str) -> None:
    if len(tokens) > n_vocab:
        raise ValueError(f"a {kind} synthetic vocabulary needs n_vocab >= {base}, got {n_vocab}")
    types += [UNUSED] * (n_vocab - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]


def _qwen(n_vocab: int) -> SyntheticVocab:
    alphabet = byte_alphabet()
    specials = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                ("<think>", USER_DEFINED), ("</think>", USER_DEFINED)]  # fmt: skip
    base = len(alphabet) + len(specials)
    split = pre_tokenizers.Split(Regex(PRE_TOKENIZERS["qwen2"].regexes[0]), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pre = pre_tokenizers.Sequence([split, byte_level])
    merges = _learn_merges(pre, alphabet, [CORPUS], n_vocab - base)
    tokens = alphabet + [left + right for left, right in merges] + [t for t, _ in specials]
    types = [NORMAL] * (len(tokens) - len(specials)) + [kind for _, kind in specials]
    _pad(tokens, types, n_vocab, base, "qwen")
    return SyntheticVocab(
        model="gpt2", pre="qwen2", tokens=tokens, token_types=types,
        merges=[f"{left} {right}" for left, right in merges], scores=None,
        bos_id=None, eos_id=tokens.index("<|im_end|>"), eot_id=None,
        pad_id=tokens.index("<|endoftext|>"), add_bos=False, chat_template=QWEN_TEMPLATE,
    )  # fmt: skip


def _mistral(n_vocab: int) -> SyntheticVocab:
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    head_types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    chars = sorted({*map(chr, range(0x21, 0x7F)), SPACE})  # every printable ASCII character
    base = len(head) + len(chars)
    pre = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    merges = _learn_merges(pre, chars, CORPUS.replace("\t", " ").splitlines(), n_vocab - base)
    pieces = [left + right for left, right in merges] + chars
    tokens = head + pieces
    types = head_types + [NORMAL] * len(pieces)
    # SentencePiece's scores: merged pieces in merge order, then single characters, all below 0.
    scores = [0.0] * len(head) + [-float(rank) for rank in range(len(pieces))]
    _pad(tokens, types, n_vocab, base, "mistral")
    scores += [-1e6] * (n_vocab - len(scores))
    return SyntheticVocab(
        model="llama", pre=None, tokens=tokens, token_types=types, merges=[], scores=scores,
        bos_id=1, eos_id=2, eot_id=None, pad_id=None, add_bos=True,
        chat_template=MISTRAL_TEMPLATE,
    )  # fmt: skip


def _harmony(n_vocab: int) -> SyntheticVocab:
    """gpt-oss's layout: byte-level BPE, pre "gpt-4o", harmony's control tokens; generation
    ends at <|return|> (eos; llama.cpp also stops at <|call|>, a tool call)."""
    alphabet = byte_alphabet()
    specials = [(t, CONTROL) for t in ("<|startoftext|>", "<|endoftext|>", "<|return|>",
                                        "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                                        "<|message|>", "<|call|>")]
    base = len(alphabet) + len(specials)
    split = pre_tokenizers.Split(Regex(PRE_TOKENIZERS["gpt-4o"].regexes[0]), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    merges = _learn_merges(pre_tokenizers.Sequence([split, byte_level]), alphabet, [CORPUS],
                           n_vocab - base)
    tokens = alphabet + [left + right for left, right in merges] + [t for t, _ in specials]
    types = [NORMAL] * (len(tokens) - len(specials)) + [kind for _, kind in specials]
    _pad(tokens, types, n_vocab, base, "harmony")
    return SyntheticVocab(
        model="gpt2", pre="gpt-4o", tokens=tokens, token_types=types,
        merges=[f"{left} {right}" for left, right in merges], scores=None,
        bos_id=tokens.index("<|startoftext|>"), eos_id=tokens.index("<|return|>"), eot_id=None,
        pad_id=tokens.index("<|endoftext|>"), add_bos=False, chat_template=HARMONY_TEMPLATE,
    )  # fmt: skip
