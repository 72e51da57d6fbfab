"""The chat page: static HTML, CSS and JS shipped in the package (no build step, nothing from a CDN), served at
`/` and `/static/…`. It streams over /v1/ws; see static/chat.js."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC_DIR)
