"""A batch's input file, checked line by line: each request line's number, custom_id and body,
or every problem found (invalid JSON, a duplicate custom_id, a url other than the batch's
endpoint, a missing body, too many lines), for the batch's `errors`."""

from __future__ import annotations

import json

from nowait.gateway.schemas import BatchError

MAX_LINES = 50_000


class BatchInputError(ValueError):
    """A batch's input file that cannot run: the batch fails with these errors."""

    def __init__(self, errors: list[BatchError]) -> None:
        super().__init__("; ".join(e.message or "" for e in errors))
        self.errors = errors


def parse_input(content: bytes, endpoint: str) -> list[tuple[int, str, str]]:
    """(line number, custom_id, body JSON) per request line, or BatchInputError listing what is wrong."""
    errors: list[BatchError] = []
    lines: list[tuple[int, str, str]] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise BatchInputError([BatchError(code="invalid_file_format", message="the input file is not UTF-8")]) \
            from None
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        before = len(errors)

        def problem(code: str, message: str, param: str | None = None, n: int = number) -> None:
            errors.append(BatchError(code=code, message=message, param=param, line=n))

        try:
            item = json.loads(raw)
        except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser goes
            problem("invalid_json_line", f"line {number} is not valid JSON ({error})")
            continue
        if not isinstance(item, dict):
            problem("invalid_json_line", f"line {number} is not a JSON object")
            continue
        custom_id, body = item.get("custom_id"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            problem("missing_required_parameter", f"line {number}: custom_id must be a non-empty string", "custom_id")
        elif custom_id in seen:
            problem("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is used twice", "custom_id")
        if item.get("method", "POST") != "POST":
            problem("invalid_method", f"line {number}: method must be POST", "method")
        if item.get("url") != endpoint:
            problem("mismatched_endpoint", f"line {number}: url {item.get('url')!r} differs from the batch's endpoint "
                                           f"{endpoint}", "url")
        if not isinstance(body, dict):
            problem("missing_required_parameter", f"line {number}: body must be a JSON object", "body")
        if len(errors) == before:
            seen.add(custom_id)
            lines.append((number, custom_id, json.dumps(body)))
    if not lines and not errors:
        errors.append(BatchError(code="empty_file", message="the input file holds no request lines"))
    if len(lines) > MAX_LINES:
        errors.append(BatchError(code="too_many_requests", message=f"at most {MAX_LINES} lines per batch"))
    if errors:
        raise BatchInputError(errors[:100])
    return lines
