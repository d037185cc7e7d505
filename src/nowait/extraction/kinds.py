"""The three document kinds: each one's JSON Schema, its lines (label synonyms and value renderers)
and its distractors (lines that look like fields but belong to no key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nowait.extraction import pools
from nowait.extraction.values import (
    Style,
    amount,
    company,
    date,
    email,
    enum,
    id_number,
    nationality,
    person,
    phone,
    term_months,
    verbatim,
)


@dataclass(frozen=True)
class FieldSpec:
    """One line of a document: its label synonyms and a renderer of (text, {field: value})."""

    labels: tuple[str, ...]
    render: Callable[[Style], tuple[str, dict[str, object]]]
    optional: bool = False


@dataclass(frozen=True)
class KindSpec:
    name: str
    titles: tuple[str, ...]
    schema: dict
    lines: tuple[FieldSpec, ...]
    distractors: tuple[FieldSpec, ...]
    footers: tuple[str, ...] = field(default=("Signature: ____________", "Page 1 of 1"))


def _single(name: str, renderer: Callable[[Style], tuple[str, object]]):
    def render(style: Style) -> tuple[str, dict[str, object]]:
        text, value = renderer(style)
        return text, {name: value}

    return render


CURRENCY_LABELS = ("Currency", "Currency code", "Ccy")


def _money(amount_key: str, currency_key: str | None, low: int, high: int):
    """An amount with its currency: the code in the amount line, or (half of the varied
    documents, as many forms do) the bare number and a separate currency line."""

    def render(style: Style) -> tuple[str, dict[str, object]] | tuple[str, dict[str, object], list]:
        currency = style.rng.choice(pools.CURRENCIES)
        separate = currency_key is not None and style.varied() and style.rng.random() < 0.5
        text, value = amount(style, low, high, currency, with_code=not separate)
        values: dict[str, object] = {amount_key: value}
        if currency_key:
            values[currency_key] = currency[0]
        if separate:
            return text, values, [(style.pick(list(CURRENCY_LABELS)), currency[0])]
        return text, values

    return render


def _string_type(optional: bool) -> dict:
    return {"type": ["string", "null"]} if optional else {"type": "string"}


def _schema(title: str, properties: dict[str, dict], required: list[str]) -> dict:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "type": "object",
        "properties": properties,
        "required": list(properties),  # every key is always emitted; optional ones may be null
        "additionalProperties": False,
        "x-nowait-optional": [k for k in properties if k not in required],
    }


DATE = {"type": "string", "format": "date"}
DATE_OR_NULL = {"type": ["string", "null"], "format": "date"}

KYC = KindSpec(
    name="kyc",
    titles=("KYC ONBOARDING FORM", "Know Your Customer (KYC) Form", "Client Due Diligence - Individual",
            "Account Opening Form", "CUSTOMER IDENTIFICATION RECORD"),
    schema=_schema(
        "KYC onboarding form",
        {
            "full_name": {"type": "string"},
            "date_of_birth": DATE,
            "nationality": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "id_number": {"type": "string"},
            "phone": {"type": "string", "pattern": "^\\+[0-9]{6,15}$"},
            "account_type": {"type": "string", "enum": ["current", "savings", "business", "joint"]},
            "email": _string_type(True),
            "occupation": _string_type(True),
        },
        ["full_name", "date_of_birth", "nationality", "id_number", "phone", "account_type"],
    ),
    lines=(
        FieldSpec(("Full name", "Name", "Customer name", "Name of customer", "Account holder"),
                  _single("full_name", person)),
        FieldSpec(("Date of birth", "DOB", "Birth date", "D.O.B.", "Born"),
                  _single("date_of_birth", lambda s: date(s, 1940, 2005))),
        FieldSpec(("Nationality", "Citizenship", "Country of citizenship"),
                  _single("nationality", nationality)),
        FieldSpec(("ID number", "Passport number", "Passport No.", "National ID", "Identity document no."),
                  _single("id_number", id_number)),
        FieldSpec(("Phone", "Mobile", "Telephone", "Contact number", "Mobile phone"),
                  _single("phone", phone)),
        FieldSpec(("Account type", "Product", "Type of account", "Account requested"),
                  _single("account_type", lambda s: enum(s, {
                      "current": ["current", "Current account", "CURRENT", "Current"],
                      "savings": ["savings", "Savings account", "SAVINGS", "Savings"],
                      "business": ["business", "Business account", "BUSINESS", "Business current account"],
                      "joint": ["joint", "Joint account", "JOINT", "Joint current account"],
                  }))),
        FieldSpec(("Email", "E-mail", "Email address"), _single("email", email), optional=True),
        FieldSpec(("Occupation", "Profession"),
                  _single("occupation", verbatim(lambda r: r.choice([
                      "Engineer", "Teacher", "Accountant", "Nurse", "Lawyer", "Trader", "Farmer",
                      "Student", "Pharmacist", "Architect", "Software developer", "Civil servant"]))),
                  optional=True),
    ),
    distractors=(
        FieldSpec(("Application date", "Date of application", "Form date"),
                  _single("_", lambda s: date(s, 2019, 2025))),
        FieldSpec(("Emergency contact phone", "Alternate phone", "Office phone"), _single("_", phone)),
        FieldSpec(("Branch", "Home branch"), _single("_", verbatim(lambda r: r.choice(pools.CITIES)))),
        FieldSpec(("Place of birth",), _single("_", verbatim(lambda r: r.choice(pools.CITIES)))),
        FieldSpec(("Reference", "Form ref."), _single("_", verbatim(lambda r: f"KYC-{r.randint(100000, 999999)}"))),
        FieldSpec(("Risk rating",), _single("_", verbatim(lambda r: r.choice(["Low", "Medium", "High"])))),
    ),
)

LETTER_OF_CREDIT = KindSpec(
    name="letter_of_credit",
    titles=("IRREVOCABLE DOCUMENTARY CREDIT", "Letter of Credit", "Documentary Credit - Issuance",
            "LETTER OF CREDIT (MT700 summary)", "Import Letter of Credit"),
    schema=_schema(
        "Letter of credit",
        {
            "lc_number": {"type": "string"},
            "issue_date": DATE,
            "expiry_date": DATE,
            "applicant": {"type": "string"},
            "beneficiary": {"type": "string"},
            # The code before the number: documents mostly write "USD 1,250,000", and a model
            # that has just copied the number must otherwise look back past it for the code.
            "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "amount": {"type": "number"},
            "issuing_bank": _string_type(True),
            "port_of_loading": _string_type(True),
            "incoterm": {"type": ["string", "null"], "enum": ["fob", "cif", "cfr", "exw", "dap", None]},
        },
        ["lc_number", "issue_date", "expiry_date", "applicant", "beneficiary", "currency", "amount"],
    ),
    lines=(
        FieldSpec(("LC number", "Documentary credit number", "L/C No.", "Credit number"),
                  _single("lc_number", verbatim(lambda r: r.choice([
                      f"LC-{r.randint(2019, 2025)}-{r.randint(1000, 99999)}",
                      f"DC{r.randint(100000, 9999999)}",
                      f"ILC/{r.randint(19, 25)}/{r.randint(1000, 9999)}"])))),
        FieldSpec(("Date of issue", "Issue date", "Issued on", "Date of issuance"),
                  _single("issue_date", lambda s: date(s, 2019, 2025))),
        FieldSpec(("Expiry date", "Date of expiry", "Expires", "Valid until"),
                  _single("expiry_date", lambda s: date(s, 2020, 2027))),
        FieldSpec(("Applicant", "Buyer", "Ordering party", "By order of"), _single("applicant", company)),
        FieldSpec(("Beneficiary", "Seller", "In favour of", "Beneficiary name"), _single("beneficiary", company)),
        FieldSpec(("Amount", "Credit amount", "Value", "Sum of"),
                  _money("amount", "currency", 5_000, 5_000_000)),
        FieldSpec(("Issuing bank", "Issued by", "Opening bank"),
                  _single("issuing_bank", verbatim(lambda r: r.choice(pools.BANKS))), optional=True),
        FieldSpec(("Port of loading", "Port of shipment", "Shipment from"),
                  _single("port_of_loading", verbatim(lambda r: r.choice(pools.PORTS))), optional=True),
        FieldSpec(("Incoterms", "Delivery terms", "Trade terms"),
                  _single("incoterm", lambda s: enum(s, {
                      code: [code, code.upper(), f"{code.upper()} (Incoterms 2020)"]
                      for code in ("fob", "cif", "cfr", "exw", "dap")
                  })), optional=True),
    ),
    distractors=(
        FieldSpec(("Latest shipment date", "Latest date of shipment"), _single("_", lambda s: date(s, 2019, 2026))),
        FieldSpec(("Advising bank", "Confirming bank"), _single("_", verbatim(lambda r: r.choice(pools.BANKS)))),
        FieldSpec(("Port of discharge", "Destination port"), _single("_", verbatim(lambda r: r.choice(pools.PORTS)))),
        FieldSpec(("Partial shipments",), _single("_", verbatim(lambda r: r.choice(["Allowed", "Not allowed"])))),
        FieldSpec(("Form of credit",),
                  _single("_", verbatim(lambda r: r.choice(["Irrevocable", "Irrevocable, confirmed"])))),
        FieldSpec(("Tolerance",), _single("_", verbatim(lambda r: f"+/- {r.choice([5, 10])}%"))),
    ),
)

LOAN_APPLICATION = KindSpec(
    name="loan_application",
    titles=("LOAN APPLICATION", "Personal Loan Application Form", "Credit Application",
            "Application for Credit Facility", "Consumer Loan Request"),
    schema=_schema(
        "Loan application",
        {
            "applicant_name": {"type": "string"},
            "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},  # before the amount, as above
            "loan_amount": {"type": "number"},
            "term_months": {"type": "integer"},
            "purpose": {"type": "string", "enum": ["home", "auto", "business", "education", "personal"]},
            "annual_income": {"type": "number"},
            "employment_status": {"type": "string",
                                  "enum": ["employed", "self_employed", "unemployed", "retired"]},
            "application_date": DATE_OR_NULL,
            "co_applicant": _string_type(True),
        },
        ["applicant_name", "currency", "loan_amount", "term_months", "purpose", "annual_income",
         "employment_status"],
    ),
    lines=(
        FieldSpec(("Applicant name", "Applicant", "Borrower", "Name of borrower"), _single("applicant_name", person)),
        FieldSpec(("Loan amount", "Amount requested", "Requested amount", "Principal"),
                  _money("loan_amount", "currency", 1_000, 900_000)),
        FieldSpec(("Term", "Loan term", "Repayment period", "Tenor"), _single("term_months", term_months)),
        FieldSpec(("Purpose", "Loan purpose", "Use of funds"),
                  _single("purpose", lambda s: enum(s, {
                      "home": ["home", "Home purchase", "Mortgage / home", "HOME"],
                      "auto": ["auto", "Car purchase", "Vehicle (auto)", "AUTO"],
                      "business": ["business", "Business expansion", "Working capital (business)", "BUSINESS"],
                      "education": ["education", "Tuition fees", "Education", "EDUCATION"],
                      "personal": ["personal", "Personal use", "Other personal", "PERSONAL"],
                  }))),
        FieldSpec(("Annual income", "Gross annual income", "Yearly income", "Income (annual)"),
                  _money("annual_income", None, 8_000, 600_000)),
        FieldSpec(("Employment status", "Employment", "Work status"),
                  _single("employment_status", lambda s: enum(s, {
                      "employed": ["employed", "Employed full-time", "Employed", "EMPLOYED"],
                      "self_employed": ["self_employed", "Self-employed", "Self employed", "SELF-EMPLOYED"],
                      "unemployed": ["unemployed", "Unemployed", "Not employed", "UNEMPLOYED"],
                      "retired": ["retired", "Retired", "Pensioner (retired)", "RETIRED"],
                  }))),
        FieldSpec(("Application date", "Date of application", "Date"),
                  _single("application_date", lambda s: date(s, 2019, 2025)), optional=True),
        FieldSpec(("Co-applicant", "Joint applicant", "Co-borrower"), _single("co_applicant", person), optional=True),
    ),
    distractors=(
        FieldSpec(("Monthly expenses", "Monthly outgoings"), _money("_", None, 200, 9_000)),
        FieldSpec(("Existing loans", "Outstanding debt"), _money("_", None, 0, 200_000)),
        FieldSpec(("Date of birth", "DOB"), _single("_", lambda s: date(s, 1945, 2003))),
        FieldSpec(("Contact phone", "Phone"), _single("_", phone)),
        FieldSpec(("Branch",), _single("_", verbatim(lambda r: r.choice(pools.CITIES)))),
        FieldSpec(("Reference", "Application ref."),
                  _single("_", verbatim(lambda r: f"LN-{r.randint(10000, 99999)}"))),
    ),
)

KIND_SPECS: dict[str, KindSpec] = {k.name: k for k in (KYC, LETTER_OF_CREDIT, LOAN_APPLICATION)}
