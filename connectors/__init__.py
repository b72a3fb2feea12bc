"""Sources (Parquet, JSONL, CSV, OpenAI Batch files, DuckDB SQL), the output store and the Parquet sink, all
over fsspec."""
from batchrun.connectors.base import InputError, Source, Unit, filesystem
from batchrun.connectors.csv_source import CsvSource
from batchrun.connectors.lines import ROW_ERROR, JsonlSource
from batchrun.connectors.openai_batch import ROW_SAMPLING, OpenAIBatchSource
from batchrun.connectors.parquet import ParquetSource
from batchrun.connectors.sink import ParquetSink
from batchrun.connectors.store import OutputStore

FORMATS = {"parquet": ParquetSource, "jsonl": JsonlSource, "csv": CsvSource, "openai_batch": OpenAIBatchSource}
EXTENSIONS = {".parquet": "parquet", ".parq": "parquet", ".pq": "parquet", ".jsonl": "jsonl",
              ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "csv"}


def open_source(uri: str, format: str | None = None, storage_options: dict | None = None) -> Source:
    """Open the input at `uri` (a path, directory, glob or fsspec URL); format inferred from the extension."""
    if format is None:
        stem = uri.rstrip("/").rsplit("/", 1)[-1]
        format = next((f for ext, f in EXTENSIONS.items() if stem.endswith(ext)), "parquet")
    if format not in FORMATS:
        raise InputError(f"input.format {format!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[format](uri, storage_options)


__all__ = ["InputError", "Source", "Unit", "ParquetSource", "JsonlSource", "CsvSource", "OpenAIBatchSource",
           "ParquetSink", "OutputStore", "open_source", "filesystem", "FORMATS", "ROW_ERROR", "ROW_SAMPLING"]
