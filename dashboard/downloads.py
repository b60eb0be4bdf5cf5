"""``/download/<resource>/<id>?field=<name>``: the whole of one field, as a plain-text file.

Pages cut long text for display (``dashboard.longtext``) and link here for the rest. The field is
named as in the resource's JSON twin (``message``, ``stack``, ``inputs.0.name``, ``config``): a
dotted path into the very data the JSON API answers, so a download shows nothing the API does
not. A text field comes as it is; anything else (a configuration) as the indented JSON the page
shows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, request
from werkzeug.exceptions import BadRequest, NotFound

from dashboard import resources
from dashboard.longtext import as_text
from dashboard.params import shown
from dashboard.resources import Resource

bp = Blueprint("downloads", __name__, url_prefix="/download")
INDEX = re.compile(r"[0-9]{1,9}")

RESOURCES: dict[str, Callable[[str], Resource]] = {
    "graphs": resources.graph,
    "violations": resources.violation,
    "compile": resources.compile_event,
    "runs": resources.run,
}


@bp.get("/<resource>/<item_id>")
def text(resource: str, item_id: str) -> Response:
    find = RESOURCES.get(resource)
    if find is None:
        raise NotFound(f"nothing to download from {shown(resource)}: try {', '.join(RESOURCES)}")
    field = request.args.get("field", "")
    if not field:
        raise BadRequest("field is required: the field's name in the JSON answer, e.g. ?field=message")
    body = as_text(_pick(find(item_id).data, field))
    name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{resource}-{item_id}-{field}")[:120]
    response = Response(body, mimetype="text/plain")
    response.headers["Content-Disposition"] = f'attachment; filename="{name}.txt"'
    return response


def _pick(data: Any, field: str) -> Any:
    """``data[a][b]...`` for ``field`` = ``a.b...``; list items by index."""
    value = data
    for part in field.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and INDEX.fullmatch(part) and int(part) < len(value):
            value = value[int(part)]
        else:
            raise NotFound(f"no field {shown(field)} here")
    return value
