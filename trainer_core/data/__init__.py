"""Training data: the JSONL schema and the staged pipeline that turns records into shard rows.

    read_records → render → tokenize → mask → align (+ advantages) → fit_length → pack / layout

Each stage is a pure function whose output has a `digest()`; `prepare` runs
the first ones over a whole file in memory, `streaming` runs them chunk by
chunk into a `store` on disk (what the plan does), and `shards` documents the
tensors the plan writes.
"""

from .advantages import AdvantageStats, group_relative_advantages, resolve_advantages
from .align import Aligned, align
from .mask import Masked, mask
from .pack import Rows, assign_rows, layout_rows, pack, packed_attention_inputs
from .pipeline import DataOptions, Prepared, Staged, finish, fit_length, prepare, stage_documents
from .render import CHATML_TEMPLATE, Rendered, load_chat_template, render, render_chatml, render_with_template
from .schema import Conversation, DataError, Message, Record, ToolCall, parse_record, read_conversations, read_records
from .tokenize import Tokenized, array_digest, load_tokenizer, tokenize

__all__ = [
    "CHATML_TEMPLATE",
    "AdvantageStats",
    "Aligned",
    "Conversation",
    "DataError",
    "DataOptions",
    "Masked",
    "Message",
    "Prepared",
    "Record",
    "Rendered",
    "Staged",
    "Rows",
    "ToolCall",
    "Tokenized",
    "align",
    "array_digest",
    "assign_rows",
    "finish",
    "fit_length",
    "group_relative_advantages",
    "layout_rows",
    "load_chat_template",
    "load_tokenizer",
    "mask",
    "pack",
    "packed_attention_inputs",
    "parse_record",
    "prepare",
    "read_conversations",
    "read_records",
    "render",
    "render_chatml",
    "render_with_template",
    "stage_documents",
    "resolve_advantages",
    "tokenize",
]
