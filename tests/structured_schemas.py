"""JSON Schemas for the structured-output tests (engine and worker), and their validation.

Each schema bounds what it lets a model write (strings have a maxLength, arrays a maxItems):
the tests run tiny random-weight models, which would otherwise fill an unbounded string until
max_tokens. Together they cover nested objects, arrays with min/max items, enums, required and
optional fields, numbers with bounds, strings with patterns and formats, anyOf/oneOf/allOf,
const, null, tuples and $ref/$defs.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

_S = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "address": {
                        "type": "object",
                        "properties": {"city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "int_array": {
        "type": "object",
        "properties": {
            "values": {
                "type": "array",
                "items": {"type": "integer", "minimum": -50, "maximum": 50},
                "minItems": 2,
                "maxItems": 5,
            }
        },
        "required": ["values"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": _S, "subtitle": _S, "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0.5, "maximum": 99.5},
            "discount": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 10, "maximum": 20},
        },
        "required": ["price", "discount", "count"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [_S, {"type": "integer", "minimum": 0, "maximum": 10}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {
            "person": {
                "type": "object",
                "properties": {"name": _S, "role": {"enum": ["chef", "waiter", "guest"]}},
                "required": ["name", "role"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"host": {"$ref": "#/$defs/person"}, "guest": {"$ref": "#/$defs/person"}},
        "required": ["host", "guest"],
        "additionalProperties": False,
    },
    "array_of_refs": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[a-z]{3}[0-9]$"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}},
        "required": ["items"],
        "additionalProperties": False,
    },
    "booleans": {
        "type": "object",
        "properties": {"spicy": {"type": "boolean"}, "vegan": {"type": "boolean"}},
        "required": ["spicy", "vegan"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "order"}, "note": _S},
        "required": ["version", "kind", "note"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {
            "m": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["m"],
        "additionalProperties": False,
    },
    "mixed_enum": {
        "type": "object",
        "properties": {"v": {"enum": ["a", 1, True, None, 2.5]}},
        "required": ["v"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"middle_name": {"anyOf": [_S, {"type": "null"}]}, "n": {"type": ["integer", "null"]}},
        "required": ["middle_name", "n"],
        "additionalProperties": False,
    },
    "date_format": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
        "additionalProperties": False,
    },
    "multiple_of": {
        "type": "object",
        "properties": {"step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}},
        "required": ["step"],
        "additionalProperties": False,
    },
    "string_lengths": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["word"],
        "additionalProperties": False,
    },
    "one_of": {
        "type": "object",
        "properties": {"x": {"oneOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9}]}},
        "required": ["x"],
        "additionalProperties": False,
    },
    "all_of": {
        "type": "object",
        "properties": {"n": {"allOf": [{"type": "integer"}, {"minimum": 3}, {"maximum": 7}]}},
        "required": ["n"],
        "additionalProperties": False,
    },
    "deep": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {
                            "c": {
                                "type": "object",
                                "properties": {"d": {"type": "array", "items": _S, "maxItems": 2}},
                                "required": ["d"],
                                "additionalProperties": False,
                            }
                        },
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "tuple": {
        "type": "object",
        "properties": {
            "pair": {
                "type": "array",
                "prefixItems": [_S, {"type": "integer", "minimum": 0, "maximum": 9}],
                "items": False,
                "minItems": 2,
            }
        },
        "required": ["pair"],
        "additionalProperties": False,
    },
    "classification": {
        "type": "object",
        "properties": {
            "label": {"enum": ["spam", "ham"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "array", "items": {"enum": ["link", "caps", "money"]}, "maxItems": 3},
        },
        "required": ["label", "confidence", "reasons"],
        "additionalProperties": False,
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 4,
    },
}

_FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def validate(text: str, schema: dict[str, Any]) -> Any:
    """The JSON value ``text`` holds, checked against ``schema`` (formats too); raises if not."""
    value = json.loads(text)
    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator, format_checker=_FORMATS)
    return value
