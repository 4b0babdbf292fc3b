"""One page of an OpenAI list (files, batches): {"object": "list", "data", "first_id",
"last_id", "has_more"}."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


def list_page(rows: list[dict[str, Any]], limit: int) -> JSONResponse:
    """The page of rows, read with one row past the limit to know whether more follow."""
    page = rows[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(rows) > limit})
