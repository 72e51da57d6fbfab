"""The chat page: static HTML, CSS and JS shipped in the package (no build step, nothing from a CDN), served at
`/` and `/static/…`. It streams over /v1/ws; see static/chat.js (and static/settings.js). Its Jobs panel
(static/jobs.js) runs JSONL files as batches through the Files and Batches API. The page links everything
relative to its own path, so a proxy may serve the gateway under a prefix (`/mii/`)."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
NO_CACHE = {"Cache-Control": "no-cache"}     # revalidated (ETag) each load: an upgrade never mixes old and new files
router = APIRouter()


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)   # HEAD: uptime checkers
async def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers=NO_CACHE)


class _StaticFiles(StaticFiles):
    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(NO_CACHE)
        return response


def static_files() -> StaticFiles:
    return _StaticFiles(directory=STATIC_DIR)
