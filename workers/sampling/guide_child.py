"""The guide compiler's child process: `python -m mii_async.workers.sampling.guide_child MODEL EOS END_IDS MEMORY PARENT`.

It reads the model's vocabulary once (tokenizer.json through `tokenizers`; no torch), says it is ready, then
compiles each regex it is sent into an outlines-core Index and sends it back in outlines-core's own binary
form (`Index.from_binary` reads it; no pickle), until its stdin closes or its parent dies (it checks each
second, even in the middle of a compile: outlines-core releases the GIL). Frames: to the child, a 4-byte
length and the regex in UTF-8; from it, a kind byte and an 8-byte length, then the payload. Its stdout is the
frames' alone: whatever a library prints goes to stderr. Ctrl-C in the terminal is the parent's to handle.
workers/sampling/guide_compiler.py is the parent's side.
"""
from __future__ import annotations

import os
import signal
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mii_async.text.token_bytes import token_bytes

FAILED, INDEX, READY, NO_VOCABULARY = 0, 1, 2, 3       # the kinds of a child's frame
HEADER = struct.Struct("<BQ")
REQUEST = struct.Struct("<I")


def _tokenizer(model_path: str) -> Any:
    from tokenizers import Tokenizer

    path = Path(model_path) / "tokenizer.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer          # a slow tokenizer's files: transformers converts them

    return AutoTokenizer.from_pretrained(model_path).backend_tokenizer


def index_bytes(index: Any) -> bytes:
    """An Index as outlines-core's own binary form, which `Index.from_binary` reads back (its pickle support
    wraps the same bytes; no pickle travels here)."""
    rebuild, (data,) = index.__reduce__()
    assert rebuild.__name__ == "from_binary" and isinstance(data, bytes), "outlines-core's Index changed its form"
    return data


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(f: Any, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.dup(1)                     # the frames' own descriptor; fd 1 (and print) now go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    model_path, eos, end_ids = argv[0], int(argv[1]), {int(i) for i in argv[2].split(",")}
    memory_bytes, parent = int(argv[3]), int(argv[4])

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()

    def send(kind: int, payload: bytes) -> None:
        write_all(out, HEADER.pack(kind, len(payload)))
        write_all(out, payload)

    import resource

    from outlines_core import Index, Vocabulary

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    try:
        vocab = {b: [i for i in ids if i not in end_ids] for b, ids in token_bytes(_tokenizer(model_path)).items()}
        vocabulary = Vocabulary(eos, {b: ids for b, ids in vocab.items() if ids})
    except Exception as exc:  # noqa: BLE001 - reported; the parent may try again with a new child
        send(NO_VOCABULARY, f"the vocabulary could not be read: {exc}".encode())
        return 2
    send(READY, b"")
    inp = sys.stdin.buffer
    while True:
        try:
            regex = _read_exact(inp, REQUEST.unpack(_read_exact(inp, REQUEST.size))[0]).decode("utf-8")
        except EOFError:
            return 0
        try:
            payload = index_bytes(Index(regex, vocabulary))
        except MemoryError:
            send(FAILED, f"its automaton needs more than {memory_bytes / 2**30:g} GiB".encode())
        except Exception as exc:  # noqa: BLE001 - outlines-core's own error types
            hint = ("; the whole output matches the regex, so leave out the anchors ^, $, \\A and \\z"
                    if "anchored" in str(exc) else "")
            send(FAILED, f"the guide cannot be compiled for this model's vocabulary: {exc}{hint}".encode())
        else:
            send(INDEX, payload)
            del payload


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
