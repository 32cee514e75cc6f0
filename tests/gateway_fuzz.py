"""The fuzzing half of tests/test_gateway_schemathesis.py, run as its own process (one per gateway,
so that two databases' runs generate their cases on two cores at once):

    python tests/gateway_fuzz.py URL    # prints {"operations", "calls", "server_errors"} as JSON

Every operation of the gateway's `/openapi.json`, EXAMPLES generated cases each (sign-ins fewer:
each checks an Argon2 hash), with the master key and a signed-in chat session and its CSRF token
(signed in again after a fuzzed logout ended it)."""
from __future__ import annotations

import json
import sys

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

MASTER, USER, PASSWORD = "sk-master-fuzz", "fuzzer", "fuzz-password-1"
COOKIE = "treeserve_chat"  # treeserve.gateway.chat.routes.COOKIE (checked by the test)
EXAMPLES = 110  # per operation (those without parameters have one case or a few)
SIGN_INS = 15


class Session:
    def __init__(self, url: str):
        self.url = url
        self.sign_in()

    def sign_in(self) -> None:
        response = httpx.post(self.url + "/chat/api/login", json={"user_id": USER, "password": PASSWORD})
        assert response.status_code == 200, response.text
        self.cookies = {COOKIE: response.cookies[COOKIE]}
        self.headers = {"Authorization": f"Bearer {MASTER}", "X-CSRF-Token": response.json()["csrf_token"]}


def fuzz(url: str) -> dict:
    session = Session(url)
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    calls, server_errors = 0, []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=SIGN_INS if operation.path == "/chat/api/login" else EXAMPLES, deadline=None,
                  suppress_health_check=list(HealthCheck), database=None, derandomize=True)
        def one(case):
            nonlocal calls
            response = case.call(base_url=url, headers=session.headers, cookies=session.cookies, timeout=60)
            calls += 1
            if response.status_code >= 500:
                server_errors.append([operation.label, response.status_code, response.text[:300],
                                      case.as_curl_command()[-300:]])
            if operation.path == "/chat/api/logout" and response.status_code == 200:
                session.sign_in()
        one()
    return {"operations": len(operations), "calls": calls, "server_errors": server_errors}


if __name__ == "__main__":
    print(json.dumps(fuzz(sys.argv[1])))
