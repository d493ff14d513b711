"""Twenty varied bounded JSON schemas for structured-output tests: nested objects, arrays with
bounds, enums, integer ranges, booleans, bounded strings and patterns. Bounded (every string,
array and number has a length or range bound), so that any model, a random one too, finishes
each within a few hundred tokens: an unbounded string or fraction is a test that depends on luck."""


def _obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


NAME = {"type": "string", "maxLength": 10}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}

SCHEMAS: list[dict] = [
    _obj({"name": NAME, "age": AGE}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}}),
    _obj({"point": _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                         "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 4}}),
    _obj({"user": _obj({"name": NAME, "admin": {"type": "boolean"}}), "level": {"enum": [1, 2, 3]}}),
    _obj({"status": {"type": "string", "enum": ["open", "closed"]}, "count": {"type": "integer", "minimum": 1,
                                                                            "maximum": 5}}),
    _obj({"items": {"type": "array", "maxItems": 2, "items": _obj({"id": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}, "label": NAME})}}),
    _obj({"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}, "confidence": {"type": "integer",
                                                                                        "minimum": 0,
                                                                                        "maximum": 100}}),
    _obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}),
    _obj({"title": {"type": "string", "minLength": 1, "maxLength": 12}, "year": {"type": "integer",
                                                                                 "minimum": 1900,
                                                                                 "maximum": 2100}}),
    _obj({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2,
                                                              "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}}}}),
    _obj({"name": NAME, "nickname": NAME}, required=["name"]),
    _obj({"kind": {"const": "event"}, "day": {"type": "integer", "minimum": 1, "maximum": 31}}),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"enum": ["US", "FR", "JP"]}}),
    _obj({"meta": _obj({"version": {"type": "integer", "minimum": 1, "maximum": 3},
                        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}})}),
    _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}),
    _obj({"first": NAME, "last": NAME, "age": AGE, "member": {"type": "boolean"}}),
]
assert len(SCHEMAS) == 20
