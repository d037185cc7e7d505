"""Letters in prose for the hard tier: the fields stated in sentences instead of labelled lines.

Each kind has an opening sentence that states its main fields, then one sentence per other
field, in a shuffled order. The first-person wording is the training layout (`letter`); the
third-person wording of a certificate is held out (`letter_third_person`). A value is never
split across lines, so every value stays one copyable span.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from nowait.extraction.hard_values import hard_date, hard_person

if TYPE_CHECKING:
    from nowait.extraction.hard_draft import Draft

# kind -> (opening with the keys it names, {key: sentences}); first person (training).
FIRST_PERSON: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "kyc": ("I, {full_name}, born on {date_of_birth}, hereby apply to open a {account_type} with your bank.", {
        "nationality": ("My nationality is {v}.", "Nationality as per my passport: {v}.",
                        "I am a citizen of {v}."),
        "id_number": ("My passport number is {v}.", "My identity document number is {v}.",
                      "I enclose a copy of my passport, number {v}."),
        "phone": ("You can reach me on {v}.", "My mobile number is {v}.", "Please call me on {v} if needed."),
        "email": ("My e-mail address is {v}.", "Please write to me at {v}.", "Statements may be e-mailed to {v}."),
        "occupation": ("My occupation is {v}.", "By profession I am: {v}.", "I am employed as: {v}."),
    }),
    "letter_of_credit": ("We hereby issue our irrevocable documentary credit No. {lc_number} dated {issue_date} "
                         "by order of {applicant} in favour of {beneficiary} for {amount}.", {
        "expiry_date": ("This credit expires on {v}.", "The credit is valid until {v}.",
                        "Documents must be presented no later than {v}, when this credit expires."),
        "port_of_loading": ("Shipment is to be made from {v}.", "Goods are to be loaded at {v}.",
                            "The port of loading is {v}."),
        "incoterm": ("Price terms: {v}.", "The goods are sold {v}.", "Delivery is on {v} terms."),
        "issuing_bank": ("For and on behalf of {v}.", "Issued by {v}.", "We, {v}, undertake to honour it."),
    }),
    "loan_application": ("I, {applicant_name}, apply for a loan of {loan_amount} to be repaid over {term_months}.", {
        "purpose": ("The loan is for {v}.", "I need the funds for {v}.", "I intend to use the money for {v}."),
        "employment_status": ("I am {v}.", "At present I am {v}.", "Regarding employment, I am {v}."),
        "annual_income": ("My gross annual income is {v}.", "I earn {v} a year before tax.",
                          "My income per year is {v}."),
        "co_applicant": ("My spouse, {v}, joins this application as co-applicant.",
                         "{v} will be my co-applicant."),
        "application_date": ("I sign this application on {v}.", "This application is dated {v}."),
    }),
}

# Held out: the third-person wording of a bank's certificate or memo.
THIRD_PERSON: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "kyc": ("This is to certify that {full_name}, whose date of birth is {date_of_birth}, has asked us to open a "
            "{account_type}.", {
        "nationality": ("The customer holds the nationality of {v}.",),
        "id_number": ("The customer's travel document bears number {v}.",),
        "phone": ("The customer may be contacted at {v}.",),
        "email": ("Correspondence may be sent to {v}.",),
        "occupation": ("The customer's stated occupation is {v}.",),
    }),
    "letter_of_credit": ("At the request of {applicant}, a documentary credit numbered {lc_number} was established "
                         "on {issue_date} for the benefit of {beneficiary}, up to {amount}.", {
        "expiry_date": ("It lapses on {v}.",),
        "port_of_loading": ("Goods are to be embarked at {v}.",),
        "incoterm": ("Trade terms agreed: {v}.",),
        "issuing_bank": ("The issuing institution is {v}.",),
    }),
    "loan_application": ("{applicant_name} (the applicant) requests credit of {loan_amount} over a period of "
                         "{term_months}.", {
        "purpose": ("The funds will be used for {v}.",),
        "employment_status": ("The applicant is {v}.",),
        "annual_income": ("Yearly earnings amount to {v}.",),
        "co_applicant": ("{v} is named as additional borrower.",),
        "application_date": ("The request was lodged on {v}.",),
    }),
}

GREETINGS = ("Dear Sir or Madam,", "To the Branch Manager,", "Dear Customer Service Team,")
CLOSINGS = ("Yours faithfully,", "Kind regards,", "Sincerely,")


def letter_lines(d: Draft, third_person: bool, rng: random.Random) -> list[str]:
    """The letter's lines: a date, a greeting, the sentences, a closing, an office-use block."""
    opening, sentences = (THIRD_PERSON if third_person else FIRST_PERSON)[d.kind]
    named = {key: d.prose[key] for key in d.prose if "{" + key + "}" in opening}
    body = [opening.format(**named)]
    rest = [rng.choice(sentences[key]).format(v=d.prose[key]) for key in d.prose if key not in named]
    rng.shuffle(rest)
    body += rest
    letter_date = hard_date(rng, 2024, 2025)[0]  # the letter's own date belongs to no field
    signer = next((d.prose[k] for k in ("full_name", "applicant_name") if k in d.prose), hard_person(rng)[0])
    lines = [f"Date: {letter_date}", "", rng.choice(GREETINGS), *body, "", rng.choice(CLOSINGS), signer]
    if d.distractors:
        lines += ["", "For office use:", *(f"{label}: {value}" for label, value in d.distractors)]
    return lines
