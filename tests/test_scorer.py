"""Scoring predictions against the truth, on hand-made cases."""

from __future__ import annotations

import json

import pytest

from nowait.extraction.scorer import score_document, summarize

KYC_TRUTH = {
    "full_name": "Ada Okafor",
    "date_of_birth": "1985-03-12",
    "nationality": "NG",
    "id_number": "A1234567",
    "phone": "+442079460958",
    "account_type": "savings",
    "email": None,
    "occupation": "Engineer",
}
LOAN_TRUTH = {
    "applicant_name": "Wei Zhang",
    "loan_amount": 5000,
    "currency": "EUR",
    "term_months": 36,
    "purpose": "auto",
    "annual_income": 42000.5,
    "employment_status": "employed",
    "application_date": None,
    "co_applicant": None,
}


def kyc(**changes) -> str:
    return json.dumps({**KYC_TRUTH, **changes})


def loan(**changes) -> str:
    return json.dumps({**LOAN_TRUTH, **changes})


def test_perfect_prediction():
    score = score_document(kyc(), KYC_TRUTH, "kyc")
    assert score.parsed and score.valid and score.exact
    assert (score.fields_correct, score.fields_total) == (8, 8)
    assert (score.present_correct, score.present_total) == (7, 7)


def test_missing_field_counts_wrong():
    prediction = {k: v for k, v in KYC_TRUTH.items() if k != "phone"}
    score = score_document(json.dumps(prediction), KYC_TRUTH, "kyc")
    assert score.parsed and not score.valid  # every key is required
    assert score.fields_correct == 7 and score.present_correct == 6
    assert not score.exact


def test_missing_null_field_counts_wrong():
    """An absent optional field must be stated as null, not omitted."""
    prediction = {k: v for k, v in KYC_TRUTH.items() if k != "email"}
    score = score_document(json.dumps(prediction), KYC_TRUTH, "kyc")
    assert score.fields_correct == 7
    assert score.present_correct == 7 and score.present_total == 7


def test_number_as_string_is_wrong():
    score = score_document(loan(loan_amount="5000"), LOAN_TRUTH, "loan_application")
    assert score.fields_correct == 8 and not score.exact
    assert not score.valid


def test_int_and_float_of_the_same_number_match():
    assert score_document(loan(loan_amount=5000.0), LOAN_TRUTH, "loan_application").exact
    assert score_document(loan(annual_income=42000.50), LOAN_TRUTH, "loan_application").exact
    assert not score_document(loan(loan_amount=5000.01), LOAN_TRUTH, "loan_application").exact


def test_string_for_null_and_null_for_value_are_wrong():
    score = score_document(kyc(email="", occupation=None), KYC_TRUTH, "kyc")
    assert score.fields_correct == 6
    assert score.present_correct == 6  # only occupation was present


def test_bool_is_not_a_number():
    truth = {**LOAN_TRUTH, "term_months": 1}
    assert score_document(loan(term_months=True), truth, "loan_application").fields_correct == 8


def test_invalid_json_scores_every_field_wrong():
    for text in ['{"full_name": "Ada Okafor", ', "not json at all", "", '{"full_name": "Ada"}}']:
        score = score_document(text, KYC_TRUTH, "kyc")
        assert not score.parsed and not score.valid and not score.exact, text
        assert score.fields_correct == 0 and score.present_correct == 0
        assert score.fields_total == 8 and score.present_total == 7


def test_json_array_is_not_an_object():
    score = score_document(json.dumps([KYC_TRUTH]), KYC_TRUTH, "kyc")
    assert not score.parsed and not score.valid
    assert score.fields_correct == 0


def test_schema_invalid_but_parseable():
    score = score_document(kyc(account_type="checking"), KYC_TRUTH, "kyc")
    assert score.parsed and not score.valid
    assert score.fields_correct == 7


def test_extra_key_is_invalid_but_fields_still_score():
    score = score_document(json.dumps({**KYC_TRUTH, "notes": "x"}), KYC_TRUTH, "kyc")
    assert score.parsed and not score.valid
    assert score.fields_correct == 8


def test_summarize_overall_and_per_kind():
    scores = [
        score_document(kyc(), KYC_TRUTH, "kyc"),  # exact
        score_document(kyc(phone="+44"), KYC_TRUTH, "kyc"),  # 7/8, schema-invalid phone
        score_document("oops", KYC_TRUTH, "kyc"),  # 0/8, unparsed
        score_document(loan(loan_amount=5000.0), LOAN_TRUTH, "loan_application"),  # exact
    ]
    summary = summarize(scores)
    assert summary["n"] == 4
    assert summary["doc_accuracy"] == pytest.approx(2 / 4)
    assert summary["field_accuracy"] == pytest.approx((8 + 7 + 0 + 9) / (8 * 3 + 9))
    assert summary["present_field_accuracy"] == pytest.approx((7 + 6 + 0 + 7) / (7 * 3 + 7))
    assert summary["json_parse_rate"] == pytest.approx(3 / 4)
    assert summary["json_valid_rate"] == pytest.approx(2 / 4)
    per_kind = summary["per_kind"]
    assert list(per_kind) == ["kyc", "loan_application"]
    assert per_kind["kyc"]["n"] == 3
    assert per_kind["kyc"]["doc_accuracy"] == pytest.approx(1 / 3)
    assert per_kind["kyc"]["field_accuracy"] == pytest.approx(15 / 24)
    assert per_kind["loan_application"]["doc_accuracy"] == 1.0


def test_summarize_empty():
    summary = summarize([])
    assert summary["n"] == 0 and summary["doc_accuracy"] == 0 and summary["per_kind"] == {}
