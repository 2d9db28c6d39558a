"""Why a job failed is one typed code (InferenceResult.error_status_code, an ErrorCode numbered as
gRPC numbers its codes), written by libs.job_results.set_failure with its name in error_code for
the clients that read the string; and which codes are the client's fault is one rule
(libs.errors.is_client_error), which reception's Infer and the saga both follow."""

from __future__ import annotations

import grpc
import pytest

from libs.errors import CLIENT_ERRORS, ServiceError, is_client_error
from libs.gen.expert.v1 import common_pb2
from libs.job_results import failure_code, set_failure
from services.reception.admission.core import raise_client_error
from services.reception.admission.sessions import raise_turn_failure

FAILURE_CODES = [code for code in grpc.StatusCode if code is not grpc.StatusCode.OK]


def failed(code: grpc.StatusCode, fields=()) -> common_pb2.InferenceResult:
    result = common_pb2.InferenceResult(job_id="job-1", status=common_pb2.JOB_STATUS_FAILED, error="refused")
    set_failure(result, code, fields)
    return result


def test_error_code_numbers_each_grpc_code_as_grpc_does():
    names = {v.name: v.number for v in common_pb2.ErrorCode.DESCRIPTOR.values}
    assert names == {"ERROR_CODE_UNSPECIFIED": 0} | {
        f"ERROR_CODE_{c.name}": c.value[0] for c in FAILURE_CODES
    }


@pytest.mark.parametrize("code", FAILURE_CODES, ids=lambda c: c.name)
def test_a_failure_is_recorded_as_its_code_and_read_back_as_it(code):
    result = failed(code, [("request.n", "too many")])
    assert failure_code(result) is code
    assert result.error_code == code.name  # the string existing clients read says the same
    assert [(f.field, f.description) for f in result.error_fields] == [("request.n", "too many")]
    assert failure_code(common_pb2.InferenceResult.FromString(result.SerializeToString())) is code


def test_a_result_without_a_failure_has_no_code():
    assert failure_code(common_pb2.InferenceResult(status=common_pb2.JOB_STATUS_COMPLETED)) is None


def test_the_client_errors_are_the_codes_that_blame_the_request():
    assert {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    } == CLIENT_ERRORS
    assert not is_client_error(grpc.StatusCode.UNAVAILABLE)
    assert not is_client_error(grpc.StatusCode.INTERNAL)


@pytest.mark.parametrize("code", FAILURE_CODES, ids=lambda c: c.name)
def test_infer_answers_a_job_failed_with_a_client_error_with_that_error_and_returns_the_others(code):
    if is_client_error(code):
        with pytest.raises(ServiceError) as refused:
            raise_client_error(failed(code))
        assert (refused.value.code, refused.value.message) == (code, "refused")
    else:
        raise_client_error(failed(code))  # a result, with its status and error


def test_infer_answers_a_stages_field_violations_as_invalid_argument():
    with pytest.raises(ServiceError) as refused:
        raise_client_error(
            failed(grpc.StatusCode.INVALID_ARGUMENT, [("request.force_experts[0]", "unknown")])
        )
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.violations == (("request.force_experts[0]", "unknown"),)


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_a_session_turn_that_failed_ends_its_call_with_the_recorded_code(code):
    with pytest.raises(ServiceError) as refused:
        raise_turn_failure(failed(code))
    assert refused.value.code is code


def test_a_session_turn_that_did_not_fail_ends_its_call_normally():
    raise_turn_failure(common_pb2.InferenceResult(status=common_pb2.JOB_STATUS_COMPLETED))
