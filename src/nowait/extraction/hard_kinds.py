"""The hard tier's fields per kind: label wordings the clean tier never uses, split into those
training may read (`labels`) and a held-out set only test and fresh-seed documents use
(`held_out`); value renderers; enum spellings for forms and for prose; letter sentences.

Truth values follow each kind's schema and canonical values (`nowait.extraction.kinds`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from nowait.extraction import pools
from nowait.extraction.hard_values import hard_date, hard_person, hard_phone, hard_term
from nowait.extraction.values import Style, company, email, id_number, nationality

Renderer = Callable[[random.Random], tuple[str, object]]


@dataclass(frozen=True)
class HardField:
    key: str
    labels: tuple[str, ...]  # hard-tier labels training reads (a few clean ones among them)
    held_out: tuple[str, ...]  # labels no training document uses
    render: Renderer | None = None  # None: a money field, rendered with its currency by the layout
    optional: bool = False
    digits: bool = False  # a date, amount or phone: look-alike letters may replace inner digits
    prose: dict[str, list[str]] = field(default_factory=dict)  # enum value -> how a letter says it
    low_high: tuple[int, int] = (0, 0)  # money fields: the amount's range


def _styled(renderer: Callable[[Style], tuple[str, object]]) -> Renderer:
    return lambda rng: renderer(Style(rng, 1.0))


def _enum(spellings: dict[str, list[str]]) -> Renderer:
    def render(rng: random.Random) -> tuple[str, object]:
        value = rng.choice(list(spellings))
        return rng.choice(spellings[value]), value

    return render


def _pick(options: list[str]) -> Renderer:
    def render(rng: random.Random) -> tuple[str, object]:
        value = rng.choice(options)
        return value, value

    return render


def _same(value: str) -> tuple[str, str]:
    return value, value


OCCUPATIONS = ["Engineer", "Teacher", "Accountant", "Nurse", "Lawyer", "Trader", "Farmer", "Student", "Pharmacist",
               "Architect", "Software developer", "Civil servant"]
CURRENCY_FIELD = HardField("currency", ("Currency of credit", "CCY", "Currency (ISO)", "Ccy."), ("Monetary unit",))

KYC = (
    HardField("full_name", ("Applicant name", "Name in full", "Customer's name", "Full Name (as in ID)"),
              ("Legal name", "Name of individual"), lambda r: hard_person(r)),
    HardField("date_of_birth", ("Date of Birth (DD/MM/YYYY)", "Birthdate", "Born on", "Date of birth"),
              ("Natal date", "Birth (date)"), lambda r: hard_date(r, 1940, 2005), digits=True),
    HardField("nationality", ("Nationality / Citizenship", "Country of nationality", "Citizen of"),
              ("Passport country", "Nationality held"), _styled(nationality)),
    HardField("id_number", ("ID / Passport No.", "Identification number", "NRIC / Passport"),
              ("Travel document number", "Identity card no"), _styled(id_number)),
    HardField("phone", ("Mobile No.", "Tel.", "Phone number", "Contact tel."), ("Handphone", "Cellular"),
              lambda r: hard_phone(r), digits=True),
    HardField("account_type", ("Type of Account", "Account category", "Account to open"),
              ("Product requested", "Account variant"),
              _enum({"current": ["Current Account", "Current a/c", "Cheque account (current)"],
                     "savings": ["Savings Account", "Savings A/C", "Savings"],
                     "business": ["Business Account", "Corporate (business) account", "Business"],
                     "joint": ["Joint Account", "Joint a/c", "Joint (two holders)"]}),
              prose={"current": ["current account", "current a/c"], "savings": ["savings account", "savings a/c"],
                     "business": ["business account", "business current account"],
                     "joint": ["joint account", "joint a/c"]}),
    HardField("email", ("E-mail address", "Email ID", "E-mail"), ("Electronic mail",), _styled(email), optional=True),
    HardField("occupation", ("Occupation / Profession", "Job title", "Occupation"), ("Line of work",),
              _pick(OCCUPATIONS), optional=True),
)

INCOTERMS = {"fob": ["FOB", "Free On Board", "FOB (Incoterms 2020)"],
             "cif": ["CIF", "Cost, Insurance and Freight", "CIF Incoterms 2020"],
             "cfr": ["CFR", "Cost and Freight", "C&F (CFR)"],
             "exw": ["EXW", "Ex Works", "EXW (Ex Works)"],
             "dap": ["DAP", "Delivered at Place", "DAP Incoterms 2020"]}

LETTER_OF_CREDIT = (
    HardField("lc_number", ("Credit No.", "DC number", "LC ref.", "L/C number"),
              ("Documentary credit ref", "Our credit reference"),
              lambda r: _same(r.choice([f"LC/{r.randint(2019, 2025)}/{r.randint(100, 99999)}",
                                        f"IDC-{r.randint(10000, 9999999)}",
                                        f"LC{r.randint(19, 25)}-{r.randint(1000, 9999)}"]))),
    HardField("issue_date", ("Date of Issue", "Issuance date", "Opened on"), ("Established on",),
              lambda r: hard_date(r, 2019, 2025), digits=True),
    HardField("expiry_date", ("Expiry", "Valid till", "Expiration date"), ("Credit lapses on",),
              lambda r: hard_date(r, 2020, 2027), digits=True),
    HardField("applicant", ("Applicant (buyer)", "Importer", "Account party"), ("Instructing party",),
              _styled(company)),
    HardField("beneficiary", ("Beneficiary (seller)", "Exporter", "Payee"), ("Drawn in favor of", "Receiving party"),
              _styled(company)),
    HardField("amount", ("Credit amount", "Amount of credit", "Face value", "Maximum amount"),
              ("Aggregate sum", "Ceiling"), None, digits=True, low_high=(5_000, 5_000_000)),
    HardField("issuing_bank", ("Issuing Bank", "Issuer", "Opened by"), ("Institution issuing",),
              _pick(pools.BANKS), optional=True),
    HardField("port_of_loading", ("Port of Loading / Airport of Departure", "Loading port", "From port"),
              ("Embarkation port",), _pick(pools.PORTS), optional=True),
    HardField("incoterm", ("Incoterm", "Terms of delivery", "Price basis"), ("Shipping basis",), _enum(INCOTERMS),
              optional=True, prose=INCOTERMS),
)

LOAN_APPLICATION = (
    HardField("applicant_name", ("Name of applicant", "Borrower name", "Applicant's full name"), ("Person applying",),
              lambda r: hard_person(r)),
    HardField("loan_amount", ("Amount of loan", "Loan amount requested", "Facility amount"), ("Sum sought",),
              None, digits=True, low_high=(1_000, 900_000)),
    HardField("term_months", ("Tenure", "Repayment term", "Loan period"), ("Duration of facility",),
              lambda r: hard_term(r)),
    HardField("purpose", ("Purpose of loan", "Reason for borrowing", "Loan for"), ("Intended use",),
              _enum({"home": ["Purchase of residential property", "Home loan", "Housing"],
                     "auto": ["Car loan", "Vehicle purchase", "Auto"],
                     "business": ["Business working capital", "SME / business", "Business"],
                     "education": ["Study fees", "Education loan", "University tuition"],
                     "personal": ["Personal", "Personal expenses", "Personal loan"]}),
              prose={"home": ["buying a home", "the purchase of our house"], "auto": ["buying a car", "a new vehicle"],
                     "business": ["expanding my business", "business working capital"],
                     "education": ["my university tuition", "education fees"],
                     "personal": ["personal expenses", "personal use"]}),
    HardField("annual_income", ("Gross yearly income", "Annual salary", "Income per annum"), ("Earnings per year",),
              None, digits=True, low_high=(8_000, 600_000)),
    HardField("employment_status", ("Employment type", "Occupation status", "Employment"), ("Working status",),
              _enum({"employed": ["Salaried", "Full-time employee", "Employed (permanent)"],
                     "self_employed": ["Own business", "Self employed / freelance", "Self-Employed"],
                     "unemployed": ["Not working", "Jobless", "Unemployed"],
                     "retired": ["Pensioner", "Retired", "Retiree"]}),
              prose={"employed": ["a salaried employee", "employed full-time"],
                     "self_employed": ["self-employed", "running my own business"],
                     "unemployed": ["not working at present", "currently unemployed"],
                     "retired": ["retired", "a pensioner"]}),
    HardField("application_date", ("Date applied", "Application dated", "Submitted on"), ("Lodged on",),
              lambda r: hard_date(r, 2019, 2025), optional=True, digits=True),
    HardField("co_applicant", ("Joint borrower", "Second applicant", "Co-applicant name"), ("Additional borrower",),
              lambda r: hard_person(r), optional=True),
)

HARD_FIELDS: dict[str, tuple[HardField, ...]] = {
    "kyc": KYC, "letter_of_credit": LETTER_OF_CREDIT, "loan_application": LOAN_APPLICATION}
# Money fields and the key of their currency.
CURRENCY_OF = {"amount": "currency", "loan_amount": "currency", "annual_income": None}
# Fields an amendment may correct (the later-dated correction is the truth).
AMENDABLE = {"kyc": ("phone", "id_number", "date_of_birth", "email"),
             "letter_of_credit": ("expiry_date", "amount", "port_of_loading"),
             "loan_application": ("loan_amount", "term_months", "application_date")}
# Lines that resemble fields (a spouse's name beside the applicant's) and belong to no key.
HARD_DISTRACTORS: dict[str, tuple[tuple[str, Renderer], ...]] = {
    "kyc": (("Name of spouse", lambda r: hard_person(r)), ("ID issue date", lambda r: hard_date(r, 2010, 2025)),
            ("Introducer", lambda r: hard_person(r)), ("Office tel.", lambda r: hard_phone(r))),
    "letter_of_credit": (("Advising bank", _pick(pools.BANKS)), ("Port of discharge", _pick(pools.PORTS)),
                         ("Latest shipment", lambda r: hard_date(r, 2019, 2026)), ("Notify party", _styled(company))),
    "loan_application": (("Guarantor", lambda r: hard_person(r)), ("Date of birth", lambda r: hard_date(r, 1945, 2003)),
                         ("Property value", _pick(["USD 450,000", "EUR 380.000,00", "GBP 615,000"])),
                         ("Monthly rent", _pick(["1,200", "850.00", "2 400"]))),
}

HELD_OUT_LABELS: frozenset[str] = frozenset(label for fields in HARD_FIELDS.values() for f in fields
                                            for label in f.held_out) | frozenset(CURRENCY_FIELD.held_out)

# More wordings per field that only the training stream draws (beside `labels`), so a model learns
# that a field is named many ways and reads the value's shape and place, not one memorised label.
# The evaluation splits keep drawing `labels` alone, so their documents are unchanged; none of
# these is a held-out label (tests/test_corpus_hard.py).
TRAINING_LABELS: dict[str, tuple[str, ...]] = {
    "full_name": ("Customer name", "Account holder", "Full name of applicant", "Name (surname first)",
                  "Client name", "Holder's name", "Name as per ID", "Your name"),
    "date_of_birth": ("DOB", "D.O.B.", "Birth date", "Date born", "Born", "Date of birth (YYYY-MM-DD)",
                      "Birthday", "Year/month/day of birth"),
    "nationality": ("Citizenship", "Country of citizenship", "Nationality (country)", "National of",
                    "Country (nationality)", "Country of origin"),
    "id_number": ("ID no.", "Passport number", "National ID", "Document no.", "ID card number",
                  "Identity no.", "Passport / ID ref."),
    "phone": ("Mobile", "Telephone", "Phone", "Mobile number", "Contact number", "Tel. no.",
              "Cell phone", "Mob."),
    "account_type": ("Account type", "Kind of account", "Account requested", "Type of a/c",
                     "Account product", "A/C type"),
    "email": ("Email", "E-mail ID", "Mail address", "Email address (optional)"),
    "occupation": ("Profession", "Job", "Employment / job title", "Designation"),
    "lc_number": ("LC number", "Credit number", "DC ref.", "L/C No.", "Reference of credit", "LC no."),
    "issue_date": ("Issue date", "Date issued", "Date of opening", "Issued on"),
    "expiry_date": ("Expiry date", "Expires on", "Valid until", "Date of expiry", "Last validity date"),
    "applicant": ("Buyer", "Applicant", "Importer (applicant)", "Ordering customer", "Opener"),
    "beneficiary": ("Seller", "Beneficiary", "Exporter (beneficiary)", "In favour of", "Payee name"),
    "amount": ("Amount", "LC amount", "Credit value", "Value of credit", "Sum of credit", "Total amount"),
    "issuing_bank": ("Bank of issue", "Issuing bank name", "Issued by"),
    "port_of_loading": ("Port of loading", "Shipment from", "Loading at", "Place of loading"),
    "incoterm": ("Delivery terms", "Trade terms", "Incoterms", "Price terms"),
    "applicant_name": ("Applicant", "Borrower", "Name of borrower", "Customer name", "Applicant (name)"),
    "loan_amount": ("Loan amount", "Amount requested", "Amount applied for", "Principal", "Facility sought"),
    "term_months": ("Term", "Tenor", "Loan term", "Repayment period", "No. of months"),
    "purpose": ("Purpose", "Loan purpose", "Use of funds", "Reason for loan"),
    "annual_income": ("Annual income", "Yearly income", "Income (annual)", "Gross annual pay", "Salary p.a."),
    "employment_status": ("Employment status", "Job status", "Employment category", "Status of employment"),
    "application_date": ("Application date", "Date of application", "Applied on", "Dated"),
    "co_applicant": ("Co-borrower", "Joint applicant", "Second borrower", "Co-applicant"),
    "currency": ("Currency", "Curr.", "Currency code", "Denomination"),
}
