"""Each service's OpenAPI document is its contract: a short schemathesis run (`--checks all`) against a
real process finds nothing. The longer run's figures are in BENCHMARKS.md (bench/fuzz_services.py)."""

from __future__ import annotations

import pytest

from tests.helpers import service_process
from tests.services.fuzz import SERVICES, build_bm25_index, run_schemathesis, service_args

pytest.importorskip("schemathesis")

BUDGET_S = 12  # per service: enough for the examples and coverage phases and a first pass of fuzzing


@pytest.mark.parametrize("service", SERVICES)
def test_openapi_contract_holds_under_fuzzing(service, tmp_path):
    index = build_bm25_index(tmp_path) if service == "retrieval-server" else None
    module, args = service_args(service, index)
    with service_process(module, *args, "--log-level", "error") as (url, _):
        result = run_schemathesis(url, BUDGET_S, seed=1)
    assert result.clean, result.summary()
    assert result.test_cases > 50 and result.served["2xx"] > 0 and result.served["4xx"] > 0
