"""The cache's table schemas, declared once and versioned.

Every Parquet file the store writes uses one of these schemas exactly; every reader checks the
manifest's ``schema_version`` against :data:`SCHEMA_VERSION`, refuses a newer one and reads an
older one with the tables of its own version (:func:`schema_of`). Bump the version whenever a column
or table is added, removed, renamed or changes meaning or unit, and keep the old declaration.

History:
- 1: ``components`` and ``instances``.
- 2: ``components`` gains ``cos_prev``; optional tables ``skips``, ``heads`` and ``gram``; the
  manifest gains ``hidden_size``, ``extra_tables``, ``chunk_size`` and ``data_sha256``.
- 3: ``instances`` gains ``prompt`` (the rendered prompt, bounded to :data:`PROMPT_CHARS`).
- 4: running-text partitions (task kind ``text``, :mod:`~layerdiv.schemas.kinds`): tables
  ``documents``, ``tokens``, ``token_blocks`` and optional ``token_lens``, ``future_effects``,
  ``future_output``; choice tasks gain the optional ``lens``; the manifest gains ``kind``,
  ``max_tokens``, ``lens``, ``skip_split`` and ``skip_seed`` (and, from the first release
  that writes the future-effects tables, ``skip_sublayers``: absent means ``block``).
- 5: the partition key gains ``revision`` (``model=<slug>/revision=<rev>/task=<task>``; older
  stores read as revision ``main``); ``tokens`` gains ``loss`` (the model's own next-token
  cross-entropy); the manifest's ``revision`` is the revision as given (older manifests held the
  hub commit there, now ``commit``) and it gains ``step``, ``tokens_seen``, ``weights_hash``
  (a fingerprint of the loaded tensors), ``n_layers`` and ``n_params_non_embedding``; the
  manifest gains ``weights`` (how the weights were made from the files given, e.g. a GGUF
  quantization dequantized to float32; absent: loaded as they are) and ``vocab_size`` (V, the
  unembedding's rows; the logit lens's uniform baseline is log V; absent in older manifests,
  where the baseline is not drawn).
  The manifest also gains ``settings``: the settings of each registered measurement with
  settings or hooks of its own (``layerdiv.measurements``), under its name (absent: none recorded);
  such a measurement's tables carry the schemas it declares.
  Every measurement's settings are there, the lens's and the future effects' too (older
  manifests' ``lens``, ``skip_split``, ``skip_seed`` and ``skip_sublayers`` are read into it), and
  each part of a measurement with settings records them in its Parquet key-value metadata
  (``layerdiv.settings``; absent in older parts); the manifest gains ``generation`` (bumped by
  each ``--overwrite`` that replaces the partition; absent: 0).
  ``future_effects`` gains ``mode`` (:data:`MODES`: ``extract --skip-mode local`` adds the
  direct-only effects, methods §10; a part without it reads as ``total``, the field's
  :data:`DEFAULT`); the future effects' settings gain ``skip_modes`` (absent: ``total``)
  and ``skip_split`` takes ``answer`` and ``answer:N:S`` (answer-anchored split points);
  ``token_blocks`` gains ``h_embed`` = h_l . h_0 (the progress ``proj``, methods §10; null in
  older parts).
  Optional table ``states`` (``extract --states``: the residual states h_0..h_L and the token id
  at sampled positions of a text task's documents, at the last prompt token of a choice task's
  instances, methods §11; its settings ``states``, ``states_seed`` and ``states_dtype`` under the
  manifest's ``settings``).
- 6: ``token_lens`` and ``lens`` gain ``final_rank`` (the rank of the model's own top-1 token
  under p_l, methods §16) and ``top1`` (p_l's own top-1 token); null in stores of version 5 and
  older.
- 7: ``tokens`` gains ``piece`` (the token as the vocabulary spells it); optional tables
  ``igrad`` and ``igrad_ends`` (``extract --igrad``: integrated gradients per
  block and position, methods §13), ``erasure`` (``extract --erase``: residual erasure, methods
  §14; with ``erasure_reference``, its reference means mu_l, stored once per partition beside
  the manifest, :data:`WHOLE_TABLES`, their fingerprint in the settings) and ``sinks``
  (``extract --sinks``: attention on the first token per block and head, methods §16), on both
  task kinds; ``documents`` gains ``answer_start`` (the answer's first token in a task with an
  answer).
- 8: ``igrad``'s ``attribution``, ``igrad_ends``' ``f_input`` and ``f_baseline`` and
  ``erasure``'s ``effect`` may be null: a document without a measurable answer (``max_tokens``
  cut it off entirely) is stored as missing, not as 0 (version 7 stored 0).
- 9: ``states`` gains ``char_end`` (the character offset in the document's text where the
  row's token ends; a text task's rows, null on a choice task and in older parts) and
  ``--states words`` stores the states at word ends: what two models with different tokenizers
  share, so that ``--maps`` can pair their rows by (doc, char_end). Optional tables
  ``token_lens_ls`` and ``token_lens_tuned`` (``extract --lens-ls FILE``, ``--lens-tuned
  FILE``: the lens statistics of a text task under a learned lens, methods §17; the columns of
  ``token_lens``; the translators' kind and fingerprint in the settings) and ``lens_stats``
  (``extract --lens-stats`` on a text task: the float64 sufficient statistics of the
  least-squares lens per block, one set per part, methods §17).

The hive partition columns (``layerdiv.store.key.KEY``: ``model``, ``revision``, ``task``) are not
stored inside the files: they come from the directory names
(``model=<slug>/revision=<rev>/task=<task>``) and are typed as strings by every reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from layerdiv.errors import LayerdivError

SCHEMA_VERSION = 10
"""Version of the on-disk layout and of the column sets below (the one this code writes)."""

OLDEST_READABLE = 1
"""Oldest schema version this code still reads."""

MAX_OPTIONS = 127
"""Most answer options a task may have (the ``option`` column is int8)."""

COMPONENT_KINDS = ("embed", "attn", "mlp", "bias")
"""Values of the ``kind`` column, in the order they can first appear in a model."""


def component_names(calls: list[tuple[str, int]]) -> list[str]:
    """The ``name`` of each component given its (kind, layer) in execution order: ``embed``,
    ``attn.<i>``, ``mlp.<i>``, ``bias``; the k-th repeat of a module (a block that runs again in
    the same forward pass) gets ``#<k>`` appended, k = 1, 2, ..."""
    seen: dict[tuple[str, int], int] = {}
    names = []
    for kind, layer in calls:
        base = kind if layer < 0 else f"{kind}.{layer}"
        k = seen.get((kind, layer), 0)
        seen[(kind, layer)] = k + 1
        names.append(base if k == 0 else f"{base}#{k}")
    return names


_COMPONENT_FIELDS_V1 = [
    pa.field("instance", pa.int32(), nullable=False),
    pa.field("component", pa.int16(), nullable=False),
    pa.field("name", pa.dictionary(pa.int16(), pa.string()), nullable=False),
    pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
    pa.field("layer", pa.int16(), nullable=False),
    pa.field("option", pa.int8(), nullable=False),
    pa.field("logit", pa.float32(), nullable=False),
    pa.field("out_norm", pa.float32(), nullable=True),
    pa.field("prefix_rms", pa.float32(), nullable=False),
    pa.field("cos_residual", pa.float32(), nullable=True),
]


def _schema(table: str, fields: list[pa.Field], version: int = SCHEMA_VERSION) -> pa.Schema:
    return pa.schema(
        fields,
        metadata={"layerdiv.table": table, "layerdiv.schema_version": str(version)},
    )


COMPONENTS = _schema(
    "components",
    [*_COMPONENT_FIELDS_V1, pa.field("cos_prev", pa.float32(), nullable=True)],
)
"""One row per (instance, component, option).

- ``instance``: the instance's index in the task's dataset order (0-based).
- ``component``: execution-order index c of the component, 0 = embedding (methods §1).
- ``name``: component name (``embed``, ``attn.<i>``, ``mlp.<i>``, ``bias``; a module that runs
  again in the same forward pass gets ``#<k>`` appended, k = 1, 2, ...).
- ``kind``: one of :data:`COMPONENT_KINDS`.
- ``layer``: decoder block index i of the module (-1 for ``embed`` and ``bias``).
- ``option``: answer option index k (0-based, in the task's option order).
- ``logit``: u_c[k], the component's contribution to option k's logit (methods §1, paper Eqs. 2-3),
  in logit units, with the final-norm scale of the full residual frozen.
- ``out_norm``: L2 norm of the component output z_c at the last prompt token (residual units);
  null for the constant ``bias`` component.
- ``prefix_rms``: the final norm's scale statistic of the prefix r_c = z_0 + ... + z_c: rms for
  RMSNorm models, the standard deviation for LayerNorm models (eps included, as the norm uses it).
  For ``bias`` it is the scale of the full residual, so the logit lens is the identity there.
- ``cos_residual``: cosine between z_c and the prefix r_(c-1) it is added to; null for c = 0 and
  for the constant ``bias`` component.
- ``cos_prev`` (version 2): cosine between z_c and the previous component's output z_(c-1)
  (methods §7); null for c = 0 and for ``bias``.
The per-component columns repeat for every option of the same (instance, component).
"""

PROMPT_CHARS = 4000
"""Most characters of a prompt the ``instances`` table keeps: a longer prompt keeps its first
:data:`PROMPT_HEAD` and last ``PROMPT_CHARS - PROMPT_HEAD`` characters (the end is where the
model answers) around an explicit marker (``layerdiv.store.tables.bounded_prompt``)."""

PROMPT_HEAD = 1000

_INSTANCE_FIELDS_V2 = [
    pa.field("instance", pa.int32(), nullable=False),
    pa.field("gold", pa.int8(), nullable=False),
    pa.field("n_tokens", pa.int32(), nullable=False),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("final_rms", pa.float32(), nullable=False),
    pa.field("model_logits", pa.list_(pa.float32()), nullable=False),
    pa.field("sum_error", pa.float32(), nullable=False),
]

_INSTANCE_FIELDS_V9 = [*_INSTANCE_FIELDS_V2, pa.field("prompt", pa.string(), nullable=False)]

INSTANCES = _schema(
    "instances", [*_INSTANCE_FIELDS_V9, pa.field("pieces", pa.list_(pa.string()), nullable=True)]
)
"""One row per instance.

- ``instance``: as in :data:`COMPONENTS`.
- ``gold``: index of the gold option.
- ``n_tokens``: prompt length in tokens as fed to the model (after any left truncation).
- ``truncated``: true when the prompt was longer than the model's context and its beginning was
  dropped to fit.
- ``final_rms``: the final norm's scale statistic of the full residual x (rms, or std for
  LayerNorm models).
- ``model_logits``: the model's own option logits (before any soft-capping), one per option.
- ``sum_error``: max over options of |sum_c u_c[k] - model_logits[k]|, divided by
  max(1, max_k sum_c |u_c[k]|): the relative error of the decomposition (methods §1).
- ``prompt`` (version 3): the prompt text the task rendered and the tokenizer encoded (before any
  left truncation; special tokens the tokenizer adds are not shown), at most
  :data:`PROMPT_CHARS` characters: a longer one is cut in the middle at an explicit marker.
- ``pieces`` (version 10): the tokens fed to the model as the vocabulary spells them, one per
  position 0..n_tokens-1 (the labels of the per-position maps of ``--erase`` and ``--igrad``;
  null where the tokenizer spells none).
"""

SKIPS = _schema(
    "skips",
    [
        pa.field("instance", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("option", pa.int8(), nullable=False),
        pa.field("logit", pa.float32(), nullable=False),
    ],
)
"""Optional (``extract --skips``). One row per (instance, skipped block, option).

- ``layer``: decoder block b replaced by the identity on every call (methods §7).
- ``logit``: the model's own option logit with that block skipped (final norm recomputed).
"""

HEADS = _schema(
    "heads",
    [
        pa.field("instance", pa.int32(), nullable=False),
        pa.field("component", pa.int16(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("head", pa.int16(), nullable=False),
        pa.field("option", pa.int8(), nullable=False),
        pa.field("logit", pa.float32(), nullable=False),
    ],
)
"""Optional (``extract --heads``). One row per (instance, attention component, head, option).

- ``component``: index of the attention component (as in :data:`COMPONENTS`) the head belongs
  to, so a block that runs twice has two sets of heads.
- ``layer``: decoder block index of that component.
- ``head``: head index 0..H-1; -1 for the output projection's bias (where the model has one).
- ``logit``: u_(b,h)[k] (methods §8), with the final scale of methods §1 frozen; the
  heads and the bias of a component sum to its ``logit`` in :data:`COMPONENTS`.
"""

GRAM = _schema(
    "gram",
    [
        pa.field("instance", pa.int32(), nullable=False),
        pa.field("gram", pa.list_(pa.float32()), nullable=False),
    ],
)
"""Optional (``extract --gram``). One row per instance.

- ``gram``: the Gram matrix G[a, b] = z_a . z_b of the component outputs at the last prompt token
  (residual units squared), components 0..C-1 in execution order without the constant ``bias``;
  the upper triangle row by row (a <= b), C(C+1)/2 values (:func:`gram_index`).
"""

LENS_FIELDS = [
    pa.field("layer", pa.int16(), nullable=False),
    pa.field("kl", pa.float32(), nullable=False),
    pa.field("top5_overlap", pa.float32(), nullable=False),
]

LENS_RANKS = [
    pa.field("final_rank", pa.int32(), nullable=False),
    pa.field("top1", pa.int32(), nullable=False),
]
"""The lens columns of version 6 (methods §16), after those of version 5."""

_LENS_FIELDS_V5 = [
    pa.field("instance", pa.int32(), nullable=False),
    *LENS_FIELDS,
    pa.field("ce", pa.float32(), nullable=False),
]

LENS = _schema("lens", [*_LENS_FIELDS_V5, *LENS_RANKS])
"""Optional (``extract --lens`` on a choice task; methods §9, logit lens at the last
prompt token). One row per (instance, layer).

- ``layer``: l = 0..L; p_l = softmax(W_U norm(h_l)) over the full vocabulary from block l's
  input h_l (l = 0: the embedding; with ``--lens last-block`` the last block is applied to h_l
  first); layer L is the model's own output distribution p_L.
- ``kl``: KL(p_l || p_L) in nats (0 at layer L).
- ``top5_overlap``: |top5(p_l) & top5(p_L)| / 5 (1 at layer L).
- ``ce``: -log p_l(first token of the gold option), in nats.
- ``final_rank`` (version 6): the rank of y, the model's own top-1 token (the argmax of p_L,
  the smallest token id among ties), under p_l: 1 + the tokens whose logit exceeds y's + the
  tokens of a smaller id whose logit equals it (1 at layer L); null in older stores.
- ``top1`` (version 6): the token id of p_l's largest probability (the smallest among ties); at
  layer L the model's own prediction y; null in older stores.
"""

_DOCUMENT_FIELDS_V4 = [
    pa.field("doc", pa.int32(), nullable=False),
    pa.field("n_tokens", pa.int32(), nullable=False),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("group", pa.string(), nullable=True),
]

DOCUMENTS = _schema(
    "documents", [*_DOCUMENT_FIELDS_V4, pa.field("answer_start", pa.int32(), nullable=True)]
)
"""Text tasks: one row per document; the chunk's completion marker (written last).

- ``doc``: the document's index in the task's file order (0-based).
- ``n_tokens``: T, tokens fed to the model (after the cut to the task's ``max_tokens``).
- ``truncated``: true when the document had more than ``max_tokens`` tokens.
- ``group``: the value of the task's ``group_field`` (e.g. ``hops``, ``level``) as a string;
  null without one.
- ``answer_start`` (version 7): s = T - A, the position of the answer's first token in a task
  with an answer (methods §10: T the document's tokens, text + answer, before any cut to
  ``max_tokens``, A the answer's own tokens); null in a task without an answer and in stores of
  version 6 and older.
"""

_TOKEN_FIELDS_V4 = [
    pa.field("doc", pa.int32(), nullable=False),
    pa.field("pos", pa.int32(), nullable=False),
    pa.field("token", pa.int32(), nullable=False),
]

_TOKEN_FIELDS_V5 = [*_TOKEN_FIELDS_V4, pa.field("loss", pa.float32(), nullable=True)]

TOKENS = _schema("tokens", [*_TOKEN_FIELDS_V5, pa.field("piece", pa.string(), nullable=True)])
"""Text tasks: one row per (doc, pos).

- ``doc``: as in :data:`DOCUMENTS`.
- ``pos``: the token's position p = 0..T-1 in its document.
- ``token``: the token id fed at that position.
- ``loss`` (version 5): the model's own next-token cross-entropy -log p_L(token at pos + 1) in
  nats, from its output distribution (methods §12, the loss of the depth law); null at
  the document's last position (and in stores of version 4).
- ``piece`` (version 7): the token as the tokenizer's vocabulary spells it
  (``convert_ids_to_tokens``: a byte-level BPE writes a leading space as ``Ġ``), for the axes of
  the per-token figures; null in stores of version 6 and older.
"""

_TOKEN_BLOCK_FIELDS_V4 = [
    pa.field("doc", pa.int32(), nullable=False),
    pa.field("pos", pa.int32(), nullable=False),
    pa.field("block", pa.int16(), nullable=False),
    *(
        pa.field(name, pa.float32(), nullable=False)
        for name in ("hh", "aa", "mm", "ha", "hm", "am")
    ),
    pa.field("dd_next", pa.float32(), nullable=True),
    pa.field("h_final", pa.float32(), nullable=False),
]

TOKEN_BLOCKS = _schema(
    "token_blocks", [*_TOKEN_BLOCK_FIELDS_V4, pa.field("h_embed", pa.float32(), nullable=True)]
)
"""Text tasks: one row per (doc, pos, block), sorted by that key (methods §9). With h
the input of block l, a what its attention sublayer adds to the residual stream, m what its MLP
adds and d_l = a + m; dot products in residual units squared, computed in the model's dtype and
reduced in float32.

- ``block``: decoder block l = 0..L-1 (h_0 is the embedding output).
- ``hh``: h.h.
- ``aa``: a.a.
- ``mm``: m.m.
- ``ha``: h.a.
- ``hm``: h.m.
- ``am``: a.m.
- ``dd_next``: d_l . d_(l+1); null for the last block.
- ``h_final``: h_l . h_L, with h_L the last residual state before the final norm.
- ``h_embed`` (version 5): h_l . h_0, with h_0 the embedding output (the progress ``proj``,
  methods §10); null in stores of version 4.
"""

_TOKEN_LENS_FIELDS_V5 = [
    pa.field("doc", pa.int32(), nullable=False),
    pa.field("pos", pa.int32(), nullable=False),
    *LENS_FIELDS,
    pa.field("ce", pa.float32(), nullable=True),
]

TOKEN_LENS = _schema("token_lens", [*_TOKEN_LENS_FIELDS_V5, *LENS_RANKS])
"""Optional (``extract --lens`` on a text task). One row per (doc, pos, layer), layer 0..L, as
:data:`LENS`.

- ``ce``: -log p_l(token at pos + 1) in nats; null at the document's last position.
- ``final_rank``, ``top1`` (version 6): as in :data:`LENS`, for the model's own top-1 next token
  y_p at position p.
"""

LEARNED_LENS_KINDS = ("ls", "tuned")
"""The learned lenses (methods §17), each stored in a table of its own (:data:`LEARNED_LENS`)."""

TOKEN_LENS_LS = _schema("token_lens_ls", [*_TOKEN_LENS_FIELDS_V5, *LENS_RANKS])
"""Optional (``extract --lens-ls FILE`` on a text task; version 9), the least-squares lens: the
columns of :data:`TOKEN_LENS` under p_l^T = softmax(W_U norm(A_l h_l + b_l)), l = 0..L-1
(methods §17); layer L is the model's own output, as in ``token_lens``. A table per learned
lens, so that a partition holds the logit lens and both learned lenses of the same tokens, each
added to stored chunks without recomputing the others."""

TOKEN_LENS_TUNED = _schema("token_lens_tuned", [*_TOKEN_LENS_FIELDS_V5, *LENS_RANKS])
"""Optional (``extract --lens-tuned FILE`` on a text task; version 9), the tuned lens: as
:data:`TOKEN_LENS_LS`."""

LEARNED_LENS = {"ls": TOKEN_LENS_LS, "tuned": TOKEN_LENS_TUNED}
"""The table of each learned lens (:data:`LEARNED_LENS_KINDS`)."""

SUBLAYERS = ("block", "attn", "mlp")
"""What a future-effects row skipped: the whole block, its attention or its MLP sublayer."""

_SKIP_KEY = [
    pa.field("doc", pa.int32(), nullable=False),
    pa.field("split", pa.int32(), nullable=False),
    pa.field("sublayer", pa.dictionary(pa.int8(), pa.string()), nullable=False),
    pa.field("skipped", pa.int16(), nullable=False),
]

MODES = ("total", "local")
"""How a future-effects row ran on (methods §10): ``total`` (every later block computes from the
changed stream) or ``local`` (each later block reads the clean stream minus block l's update at
the removed positions: the direct effect only)."""

DEFAULT = b"layerdiv.default"
"""Field metadata key: the value a column takes in parts written before it existed (read as
null where a field has none)."""

_FUTURE_EFFECT_VALUES = [
    pa.field("block", pa.int16(), nullable=False),
    pa.field("rel_change", pa.float32(), nullable=False),
]

FUTURE_EFFECTS = _schema(
    "future_effects",
    [
        *_SKIP_KEY,
        pa.field(
            "mode",
            pa.dictionary(pa.int8(), pa.string()),
            nullable=False,
            metadata={DEFAULT: b"total"},
        ),
        *_FUTURE_EFFECT_VALUES,
    ],
)
"""Optional (``extract --skips`` on a text task; methods §9, future effects). One row
per (doc, split, sublayer, skipped, block).

- ``doc``: as in :data:`DOCUMENTS`.
- ``split``: the split point t (0 with ``--skip-split all``).
- ``sublayer``: one of :data:`SUBLAYERS`, what was skipped.
- ``skipped``: block l whose output (or sublayer's addition) was replaced by its input at
  positions 1..t-1 (every position but the first with ``--skip-split all``).
- ``mode`` (version 5): one of :data:`MODES`; ``total`` in stores of version 4.
- ``block``: affected block j.
- ``rel_change``: max over p >= t of ||d'_j - d_j|| / max(||d_j||, 1e-6), d' the updates of the
  run of its ``mode`` (``local``: what block j computes from the clean stream minus block l's
  update at the removed positions, before its output is set back to that stream; methods §10).
"""

FUTURE_OUTPUT = _schema(
    "future_output",
    [*_SKIP_KEY, pa.field("out_change", pa.float32(), nullable=False)],
)
"""Optional (``extract --skips`` on a text task). One row per (doc, split, sublayer, skipped), as
:data:`FUTURE_EFFECTS`.

- ``out_change``: max over p >= t of the L2 distance between the skipped and the clean run's
  next-token distributions.
"""

STATE_TYPES = {"float16": pa.float16(), "bfloat16": pa.uint16(), "float32": pa.float32()}
"""``extract --states-dtype`` values and the Arrow element type of the ``state`` list of each
(Arrow has no bfloat16: a bfloat16 state is stored as its 16 raw bits, the high half of the
float32 it rounds)."""


_STATE_KEY_V8 = [
    pa.field("doc", pa.int32(), nullable=False),
    pa.field("pos", pa.int32(), nullable=False),
    pa.field("token", pa.int32(), nullable=False),
    pa.field("layer", pa.int16(), nullable=False),
]
_STATE_KEY = [*_STATE_KEY_V8, pa.field("char_end", pa.int32(), nullable=True)]


def states_schema(width: int, dtype: str, key: Sequence[pa.Field] = tuple(_STATE_KEY)) -> pa.Schema:
    """The ``states`` schema of a partition whose residual stream has ``width`` d, stored as
    ``dtype`` (one of :data:`STATE_TYPES`), with the key columns ``key`` (the current ones)."""
    state = pa.field("state", pa.list_(STATE_TYPES[dtype], width), nullable=False)
    return _schema("states", [*key, state])


STATES = _schema("states", [*_STATE_KEY, pa.field("state", pa.list_(pa.float16()), nullable=False)])
"""Optional (``extract --states``). One row per (doc, pos, layer) of the stored positions
(methods §11), sorted by doc, pos, layer: on a text task K sampled positions per document
(``--states K|all``), on a choice task the last prompt token of each instance.

- ``doc``: the document's index in the task's order (a choice task: the instance's).
- ``pos``: token position p (0-based; never 0 on a text task; the prompt's last on a choice task).
- ``token``: the token id at ``pos`` (two models' rows are mapped where these agree).
- ``char_end``: on a text task, the character offset in the document's text where the token at
  ``pos`` ends (the tokenizer's offsets; null on a choice task, with a tokenizer that gives no
  offsets, and in parts of version 8 and older). Two models whose tokenizers differ are mapped
  on the rows whose tokens end at the same character (``--states words``).
- ``layer``: l = 0..L: h_0 the embedding output, h_l block l-1's output, h_L before the final
  norm.
- ``state``: h_l at (doc, pos), a fixed-size list of the partition's d values in the
  manifest's ``states_dtype`` (:func:`states_schema`: ``float16``, ``float32``, or ``bfloat16``
  stored as its raw 16 bits). Vectors: read per partition (``PartitionInfo.states``),
  not through the query views.
"""


def schema_matches(table: str, found: pa.Schema, expected: pa.Schema) -> bool:
    """Whether a part's ``found`` schema is ``table``'s ``expected`` one (``states``: any width
    and stored dtype of :func:`states_schema`)."""
    if table != "states":
        return found.equals(expected, check_metadata=False)
    state = found.field("state").type if "state" in found.names else None
    key = [f for f in expected if f.name != "state"]
    return (
        isinstance(state, pa.FixedSizeListType)
        and any(state.value_type == t for t in STATE_TYPES.values())
        and found.equals(
            states_schema(state.list_size, _dtype_of(state), key), check_metadata=False
        )
    )


def _dtype_of(state: pa.FixedSizeListType) -> str:
    return next(k for k, t in STATE_TYPES.items() if state.value_type == t)


VECTOR_TABLES = {
    "states": "PartitionInfo.states",
    "lens_stats": "layerdiv.measurements.lens_stats.read_sums",
}
"""Tables of vectors whose width differs between partitions: not in the query views; each with
what reads it per partition."""

SKIP_KEYS = {
    "future_effects": (*(f.name for f in _SKIP_KEY), "mode", "block"),
    "future_output": tuple(f.name for f in _SKIP_KEY),
}
"""The key columns of the future-effects tables: no two rows of a part share them (readers
check it, :meth:`layerdiv.store.PartitionInfo.batches`)."""

IGRAD = _schema(
    "igrad",
    [
        pa.field("doc", pa.int32(), nullable=False),
        pa.field("sublayer", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("block", pa.int16(), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("attribution", pa.float32(), nullable=True),
    ],
)
"""Optional (``extract --igrad``; methods §13). One row per (doc, sublayer, block, pos), sorted
so: the integrated-gradients attribution map.

- ``doc``: the document's index in the task's order (a choice task: the instance's).
- ``sublayer``: the site, one of :data:`SUBLAYERS`: ``block`` (block l's output h_(l+1)),
  ``attn`` or ``mlp`` (the sublayer's output, before it is added).
- ``block``: block l, 0-based (as ``skipped`` in :data:`FUTURE_EFFECTS`).
- ``pos``: token position t (0-based; a choice task: the prompt's positions).
- ``attribution``: IG(l, t) = sum_d (x - b)[t, d] (1/m) sum_k df/dx[t, d] at x(alpha_k) (a left
  Riemann sum over m steps, the partition's ``igrad_steps``); null for every row of a document
  without a measurable answer (``max_tokens`` cut it off entirely), as its ends.
"""

IGRAD_ENDS = _schema(
    "igrad_ends",
    [
        pa.field("doc", pa.int32(), nullable=False),
        pa.field("sublayer", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("block", pa.int16(), nullable=False),
        pa.field("f_input", pa.float32(), nullable=True),
        pa.field("f_baseline", pa.float32(), nullable=True),
    ],
)
"""Optional (``extract --igrad``; methods §13). One row per (doc, sublayer, block), as
:data:`IGRAD`: the target at the path's two ends, so that the completeness gap
sum_t IG(l, t) - (f(x) - f(b)) can be shown.

- ``f_input``: f(x), the target with the site's own activation (alpha = 1).
- ``f_baseline``: f(b), the target with every position's activation set to the baseline b, the
  site's mean over the document's positions (alpha = 0).

Both null where the document has no measurable answer.
"""

ERASURE = _schema(
    "erasure",
    [
        pa.field("doc", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("effect", pa.float32(), nullable=True),
    ],
)
"""Optional (``extract --erase``; methods §14). One row per (doc, layer, pos), sorted so: the
residual-erasure map.

- ``doc``: as in :data:`IGRAD`.
- ``layer``: state l = 0..L (as in :data:`STATES`: h_0 the embedding output, h_l block l-1's
  output).
- ``pos``: the position t whose state h_l alone was replaced by the reference mean mu_l (a
  choice task: every prompt position, T - 1 the readout position itself).
- ``effect``: max over the answer-predicting positions j of ||softmax(z'_j) - softmax(z_j)||_2
  (a choice task: the change of the option-probability vector at the last prompt token); exact 0
  where t lies after every such position, and for the last state h_L where t is not one of them
  (not computed); null for every row of a document without a measurable answer (``max_tokens``
  cut it off entirely: no position predicts an answer token).
"""

ERASURE_REFERENCE = _schema(
    "erasure_reference",
    [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("state", pa.list_(pa.float32()), nullable=False),
    ],
)
"""Optional (``extract --erase``; methods §14), one file per partition beside its manifest
(:data:`WHOLE_TABLES`), written before its first chunk; its fingerprint
(``erase_reference_sha256``: the sha256 of the (L + 1, d) float32 values) is part of the
partition's settings. One row per layer, in order.

- ``layer``: state l = 0..L (as in :data:`ERASURE`).
- ``state``: the reference mean mu_l: h_l averaged over every position (BOS included) of the
  task's first R documents (a choice task: prompts), R the partition's ``erase_reference``; d
  float32 values.
"""

WHOLE_TABLES = ("erasure_reference",)
"""Tables stored once per partition rather than per chunk (``layerdiv.store.paths.Partition.whole``:
beside the manifest), each written by a measurement before the partition's first chunk."""

SINKS = _schema(
    "sinks",
    [
        pa.field("doc", pa.int32(), nullable=False),
        pa.field("block", pa.int16(), nullable=False),
        pa.field("head", pa.int16(), nullable=False),
        pa.field("bos_attention", pa.float32(), nullable=False),
    ],
)
"""Optional (``extract --sinks``; methods §16). One row per (doc, block, head), sorted so (none
for a unit of one token, which has no query position after the first).

- ``doc``: as in :data:`IGRAD`.
- ``block``: block l, 0-based.
- ``head``: query head h of block l's attention.
- ``bos_attention``: the mean over query positions p = 1..T-1 of the attention weight on key
  position 0 (after the softmax, as the model computes it: rotary, grouped-query and
  sliding-window attention included).
"""

LENS_STATS = _schema(
    "lens_stats",
    [
        pa.field("block", pa.int16(), nullable=False),
        pa.field("tokens", pa.int64(), nullable=False),
        pa.field("sum_h", pa.list_(pa.float64()), nullable=False),
        pa.field("sum_final", pa.list_(pa.float64()), nullable=False),
        pa.field("sum_hh", pa.list_(pa.float64()), nullable=False),
        pa.field("sum_hfinal", pa.list_(pa.float64()), nullable=False),
    ],
)
"""Optional (``extract --lens-stats`` on a text task; methods §17). One row per block l = 0..L-1
of each part (L rows, in block order): the float64 sums over every token of the part's documents
(BOS included), from which ``layerdiv fit-lens --kind ls`` solves the least-squares lens. A
part's sums are its own documents' alone (its name gives them), so the sums of a partition are
the sums over its parts, however its chunks were sharded, resumed or merged.

- ``block``: block l, 0-based; h_l its input (h_0 the embedding output).
- ``tokens``: n, the tokens summed over (the same in every row of a part).
- ``sum_h``: sum h_l (d values).
- ``sum_final``: sum h_L, the last residual state before the final norm (d values; the same in
  every row of a part).
- ``sum_hh``: sum h_l h_l^T (d x d values, row-major).
- ``sum_hfinal``: sum h_l h_L^T (d x d values, row-major: entry (i, j) sums h_l[i] h_L[j]).
"""

TABLES = {
    "components": COMPONENTS,
    "instances": INSTANCES,
    "skips": SKIPS,
    "heads": HEADS,
    "gram": GRAM,
    "lens": LENS,
    "documents": DOCUMENTS,
    "tokens": TOKENS,
    "token_blocks": TOKEN_BLOCKS,
    "token_lens": TOKEN_LENS,
    "token_lens_ls": TOKEN_LENS_LS,
    "token_lens_tuned": TOKEN_LENS_TUNED,
    "future_effects": FUTURE_EFFECTS,
    "future_output": FUTURE_OUTPUT,
    "states": STATES,
    "igrad": IGRAD,
    "igrad_ends": IGRAD_ENDS,
    "erasure": ERASURE,
    "erasure_reference": ERASURE_REFERENCE,
    "sinks": SINKS,
    "lens_stats": LENS_STATS,
}
"""Every table of the store by name, as this version writes them."""


@dataclass(frozen=True)
class Grid:
    """The key of a dense table: every unit (the values of the ``units`` columns) holds the same
    cells (the values of the ``cells`` columns), each once, rows in key order (readers check it
    in one place, ``layerdiv.store.parts.dense``)."""

    units: tuple[str, ...]
    cells: tuple[str, ...]


GRIDS: dict[str, Grid] = {
    "components": Grid(("instance",), ("component", "option")),
    "heads": Grid(("instance",), ("component", "head", "option")),
    "states": Grid(("doc", "pos"), ("layer",)),
}
"""The key grid of each table read whole into dense arrays: ``components`` every component and
option of each instance; ``heads`` the same heads and options of each instance; ``states``
every layer 0..L of each stored (doc, pos)."""


Bound = float | str
"""One end of a column's range (:class:`Rules`): a number, or a fact of the partition: ``L``
(its blocks), ``V`` (its vocabulary, where the manifest records it), ``T`` (the chunk's longest
unit, in tokens), ``A`` (a choice task: 1; a text task: the most answer tokens a document of
the chunk keeps); ``X-1`` one less."""

Range = tuple[Bound, Bound]

PROBABILITY: Range = (0.0, 1.0)
NONNEGATIVE: Range = (0.0, float("inf"))
DISTANCE: Range = (0.0, 2.0**0.5)
"""The L2 distance between two probability vectors."""

EXTENTS: dict[str, Range] = {
    "tokens": (0, "T-1"),
    "blocks": (0, "L-1"),
    "states": (0, "L"),
}
"""The extents of a :attr:`Rules.grid` column, as a range of values (``tokens``: of the unit's
own tokens; ``shared``, the values the part holds, has none)."""


@dataclass(frozen=True)
class Rules:
    """What the rows of a table may hold beyond its columns' types, read by every reader
    (``layerdiv.store.checks``): on open, each part's min/max statistics against :attr:`bounds`
    (and the grid's extents); where a part is read, every unit's key rows against :attr:`grid`.
    Declared by whoever writes the table: a measurement in its declaration
    (``Measurement.rules``), a task kind for its required tables
    (:attr:`~layerdiv.schemas.kinds.Kind.rules`); ``layerdiv.measurements.table_rules`` looks
    them up. The shared ranges (:data:`PROBABILITY`, :data:`NONNEGATIVE`, :data:`DISTANCE`) are
    defined here."""

    grid: tuple[tuple[str, str], ...] = ()
    """The key columns after the unit's (``doc``, ``instance``), each with its extent: every
    unit (of at least :attr:`least` tokens) holds each combination once, no other row: ``tokens``
    0..T-1 (T the unit's ``n_tokens``), ``blocks`` 0..L-1, ``states`` 0..L, ``shared`` the
    values the part holds (each unit all of them; integers 0..n-1: the heads)."""
    bounds: dict[str, Range] | None = None
    """The inclusive range of other columns' values (floats within a rounding's slack)."""
    least: int = 1
    """Units of fewer tokens hold no rows."""

    def ranges(self) -> dict[str, Range]:
        """Every bounded column: the grid's (by extent) and :attr:`bounds`."""
        grid = {c: EXTENTS[e] for c, e in self.grid if e in EXTENTS}
        return {**grid, **(self.bounds or {})}


def _not_null(schema: pa.Schema, version: int) -> pa.Schema:
    """``schema`` with every field non-nullable, as ``version`` declared it."""
    table = schema.metadata[b"layerdiv.table"].decode()
    return _schema(table, [f.with_nullable(False) for f in schema], version=version)


_OLDER: dict[str, dict[int, pa.Schema]] = {
    **{t: {7: _not_null(TABLES[t], 7)} for t in ("igrad", "igrad_ends", "erasure")},
    "components": {1: _schema("components", _COMPONENT_FIELDS_V1, version=1)},
    "instances": {
        1: _schema("instances", _INSTANCE_FIELDS_V2, version=1),
        2: _schema("instances", _INSTANCE_FIELDS_V2, version=2),
        9: _schema("instances", _INSTANCE_FIELDS_V9, version=9),
    },
    "documents": {6: _schema("documents", _DOCUMENT_FIELDS_V4, version=6)},
    "tokens": {
        4: _schema("tokens", _TOKEN_FIELDS_V4, version=4),
        6: _schema("tokens", _TOKEN_FIELDS_V5, version=6),
    },
    "token_blocks": {4: _schema("token_blocks", _TOKEN_BLOCK_FIELDS_V4, version=4)},
    "states": {
        8: _schema(
            "states",
            [*_STATE_KEY_V8, pa.field("state", pa.list_(pa.float16()), nullable=False)],
            version=8,
        )
    },
    "lens": {5: _schema("lens", _LENS_FIELDS_V5, version=5)},
    "token_lens": {5: _schema("token_lens", _TOKEN_LENS_FIELDS_V5, version=5)},
    "future_effects": {
        4: _schema("future_effects", [*_SKIP_KEY, *_FUTURE_EFFECT_VALUES], version=4)
    },
}
"""The earlier shapes of each table whose columns changed, each under the last schema version
that wrote it."""


def schema_of(table: str, version: int) -> pa.Schema | None:
    """The schema of ``table`` as a store of schema ``version`` holds it (None: not a table of
    this module). Which tables a version has is declared beside them: a task kind's required
    tables since :attr:`~layerdiv.schemas.kinds.Kind.since`, a measurement's since the version
    it declares for each (``layerdiv.measurements.tables_of``)."""
    for last, schema in sorted(_OLDER.get(table, {}).items()):
        if version <= last:
            return schema
    return TABLES.get(table)


def token_key(docs: Sequence[int], n_tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(doc, pos) of every token of the documents ``docs`` of ``n_tokens`` tokens each, in order:
    the key of the per-token tables."""
    counts = np.asarray(n_tokens, np.int64)
    doc = np.repeat(np.asarray(docs, np.int32), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return doc, (np.arange(counts.sum()) - starts).astype(np.int32)


def gram_index(a: int, b: int, n: int) -> int:
    """Position of G[a, b] (a <= b < n) in the flattened upper triangle of :data:`GRAM`."""
    return a * n - a * (a - 1) // 2 + (b - a)


class SchemaError(LayerdivError, ValueError):
    """A file or manifest does not match the schema this version of layerdiv reads."""


def check_version(version: object, where: str) -> None:
    """Refuse a store written with a schema version this code cannot read."""
    if not isinstance(version, int):
        raise SchemaError(f"{where}: no valid schema_version (got {version!r}); re-extract it.")
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{where}: written with schema version {version}, newer than this layerdiv reads "
            f"({SCHEMA_VERSION}); upgrade layerdiv (pip install -U layerdiv)."
        )
    if version < OLDEST_READABLE:
        raise SchemaError(
            f"{where}: written with old schema version {version} (this layerdiv reads "
            f"{OLDEST_READABLE} to {SCHEMA_VERSION}); re-extract it with --overwrite."
        )


def require_columns(
    version: int, table: str, columns: tuple[str, ...], where: str, flag: str = ""
) -> None:
    """Refuse an analysis that needs ``columns`` of ``table`` in a store of an older version
    (or a partition extracted without the table), saying what to re-extract."""
    schema = schema_of(table, version)
    missing = [c for c in columns if schema is None or c not in schema.names]
    if missing:
        how = f"re-extract it with {flag} --overwrite" if flag else "re-extract it with --overwrite"
        raise SchemaError(
            f"{where}: needs {table}.{', '.join(missing)}, which schema version {version} does "
            f"not have; {how}."
        )
