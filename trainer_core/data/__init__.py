"""Training data: the files and formats read, the schema, and the staged pipeline that turns records into shard rows.

    data.path → files (data_sources) → rows (readers) → messages records (formats) → validated records (records)
      → render → tokenize → mask → align (+ advantages) → fit_length → pack / layout

Each stage is a pure function whose output has a `digest()`; `prepare` runs
the first ones over a whole file in memory, `streaming` runs them chunk by
chunk into a `store` on disk (what the plan does), and `shards` documents the
tensors the plan writes.
"""

from ..data_sources import DataFile, data_files
from .advantages import AdvantageStats, group_relative_advantages, resolve_advantages
from .align import Aligned, align
from .mask import Masked, mask
from .pack import Rows, assign_rows, layout_rows, pack, packed_attention_inputs
from .pipeline import DataOptions, Prepared, Staged, finish, fit_length, prepare, stage_documents
from .records import DataSource, iter_records, open_source, read_conversations, read_records, source_of
from .render import CHATML_TEMPLATE, Rendered, load_chat_template, render, render_chatml, render_with_template
from .schema import Conversation, DataError, Message, Record, ToolCall, parse_record
from .tokenize import Tokenized, array_digest, load_tokenizer, tokenize

__all__ = [
    "CHATML_TEMPLATE",
    "AdvantageStats",
    "Aligned",
    "Conversation",
    "DataError",
    "DataFile",
    "DataSource",
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
    "data_files",
    "finish",
    "fit_length",
    "group_relative_advantages",
    "iter_records",
    "layout_rows",
    "load_chat_template",
    "load_tokenizer",
    "mask",
    "open_source",
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
    "source_of",
    "tokenize",
]
