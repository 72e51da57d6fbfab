"""The multipart/form-data body of `POST /v1/files`, read with the standard library's MIME parser (the body is
already bounded by the gateway's max_body_bytes, so it is parsed whole, in memory)."""
from __future__ import annotations

import email.parser
import email.policy
from typing import NamedTuple

from ..errors import InvalidParameterError


class Upload(NamedTuple):
    filename: str
    purpose: str
    data: bytes


def parse_upload(content_type: str, body: bytes) -> Upload:
    """The `file` part and the `purpose` field of an upload; InvalidParameterError naming what is missing."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidParameterError("file", "upload the file as multipart/form-data (fields 'file' and 'purpose'), "
                                    f"not {content_type or 'a body without Content-Type'}")
    head = b"Content-Type: " + content_type.encode("latin-1") + b"\r\nMIME-Version: 1.0\r\n\r\n"
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not msg.is_multipart():
        raise InvalidParameterError("file", "the multipart body could not be read (a boundary is missing)")
    file: tuple[str, bytes] | None = None
    purpose: str | None = None
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True) or b""
        if name == "file":
            file = (part.get_filename() or "upload.jsonl", payload)
        elif name == "purpose":
            purpose = payload.decode("utf-8", "replace").strip()
    if file is None:
        raise InvalidParameterError("file", "the upload has no 'file' part")
    if purpose is None:
        raise InvalidParameterError("purpose", "the upload has no 'purpose' field; use 'batch'")
    return Upload(file[0], purpose, file[1])
