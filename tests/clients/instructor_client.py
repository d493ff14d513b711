"""instructor, as shipped, against a tandem server: asks for a Person in the given mode and prints it
as JSON on stdout. Run from the repository root with the instructor virtualenv's Python (instructor
pins a jiter the newest openai SDK cannot use, so it lives apart: `make instructor`):

    .venv-instructor/bin/python -m tests.clients.instructor_client --base-url URL --model M --mode TOOLS
"""

import argparse
import json

import instructor
from openai import OpenAI

from tests.clients.person import Person


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI base URL (ending in /v1)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", required=True, help="an instructor.Mode name, e.g. TOOLS or JSON_SCHEMA")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--extra-body", type=json.loads, default=None, help="a JSON object sent with the request")
    args = parser.parse_args()
    client = instructor.from_openai(OpenAI(base_url=args.base_url, api_key="unused"),
                                    mode=getattr(instructor.Mode, args.mode))
    person = client.chat.completions.create(model=args.model, response_model=Person, max_tokens=args.max_tokens,
                                            extra_body=args.extra_body,
                                            messages=[{"role": "user", "content": "Describe a person."}])
    assert isinstance(person, Person), person
    print(json.dumps({"person": person.model_dump()}))


if __name__ == "__main__":
    main()
