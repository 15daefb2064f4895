"""Validates custom resources against the openAPIV3Schema of their CustomResourceDefinitions.

    python3 validate_crds.py --crd CRD.yaml [--crd ...] MANIFEST.yaml...

Every document of a MANIFEST whose apiVersion and kind a CRD defines is checked with
jsonschema, strictly: a field the schema does not declare is an error, as with
`kubectl apply --validate=strict`. Not checked: the CRD's CEL rules (x-kubernetes-validations),
which only an API server evaluates. Documents of other kinds are skipped (and listed).
Exit status 1 if any document fails. Needs PyYAML and jsonschema.
"""

import argparse
import copy
import sys

import jsonschema
import yaml


def strict(schema):
    """The schema with undeclared fields refused wherever an object declares its fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def load_crds(paths):
    schemas = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for doc in yaml.safe_load_all(f):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for version in spec["versions"]:
                    key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                    schemas[key] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crd", action="append", default=[], help="a CRD file (repeatable)")
    parser.add_argument("manifests", nargs="+")
    args = parser.parse_args()
    schemas = load_crds(args.crd)
    failed = checked = 0
    for path in args.manifests:
        with open(path, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for doc in docs:
            key = (doc.get("apiVersion"), doc.get("kind"))
            name = f"{path}: {key[1]} {doc.get('metadata', {}).get('name')} ({key[0]})"
            schema = schemas.get(key)
            if schema is None:
                print(f"SKIP {name}: no CRD given for it")
                continue
            checked += 1
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
            if errors:
                failed += 1
                for error in errors:
                    where = ".".join(str(p) for p in error.path) or "(root)"
                    print(f"FAIL {name}: {where}: {error.message}")
            else:
                print(f"PASS {name}")
    print(f"{checked - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
