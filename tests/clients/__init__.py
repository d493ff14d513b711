"""Client scripts that run in their own virtualenvs (a library whose pins clash with the test
install's), as subprocesses against a running tandem server; they import only the standard
library, their client library and pydantic (tests/clients/person.py)."""
