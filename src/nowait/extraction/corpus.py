"""Synthetic business documents with ground-truth JSON: KYC forms, letters of credit, loan files.

Every document is a function of (split, index) alone, so any document can be regenerated
anywhere, splits are reproducible, and a fresh `--seed` sample is a different stream of the
same distribution. `variety` in [0, 1] is the chance of each non-canonical choice (label
synonym, value format, distractor, honorific, noise, shuffled order); variety 0 gives clean
documents whose values are already normalized, which training uses as a copying warm-up.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count

from nowait.extraction import pools

KINDS = ("kyc", "letter_of_credit", "loan_application")
KIND_TITLES = {
    "kyc": "KYC onboarding form",
    "letter_of_credit": "letter of credit",
    "loan_application": "loan application",
}
SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Document:
    """One synthetic document and the JSON an extractor must produce for it."""

    kind: str
    text: str
    fields: dict[str, object]
    doc_id: str = ""

    def answer_json(self) -> str:
        return canonical_json(self.fields)


def canonical_json(fields: dict[str, object]) -> str:
    """The one serialization every model is trained to emit: one line, schema key order."""
    return json.dumps(fields, ensure_ascii=False)


class Style:
    """Random choices with a knob: each call departs from the canonical choice with p=variety."""

    def __init__(self, rng: random.Random, variety: float) -> None:
        self.rng = rng
        self.variety = variety

    def varied(self) -> bool:
        return self.rng.random() < self.variety

    def pick(self, options: list | tuple):
        """The first option is canonical; the others are reached only when `varied()`."""
        return self.rng.choice(options) if self.varied() else options[0]


# --- value renderers: each returns (text as it appears in the document, normalized value) ---


def _date(style: Style, start_year: int, end_year: int) -> tuple[str, str]:
    rng = style.rng
    year, month, day = rng.randint(start_year, end_year), rng.randint(1, 12), rng.randint(1, 28)
    name = pools.MONTHS[month - 1]
    formats = [
        f"{year:04d}-{month:02d}-{day:02d}",
        f"{day:02d}.{month:02d}.{year:04d}",
        f"{day:02d}/{month:02d}/{year:04d}",
        f"{day} {name} {year}",
        f"{name} {day}, {year}",
        f"{day:02d}-{name[:3]}-{year}",
        f"{day} {name[:3].upper()} {year}",
        f"{year:04d}/{month:02d}/{day:02d}",
    ]
    return style.pick(formats), f"{year:04d}-{month:02d}-{day:02d}"


def _person(style: Style) -> tuple[str, str]:
    rng = style.rng
    name = f"{rng.choice(pools.FIRST_NAMES)} {rng.choice(pools.LAST_NAMES)}"
    if style.varied() and rng.random() < 0.5:
        return f"{rng.choice(pools.HONORIFICS)} {name}", name
    return name, name


def _company(style: Style) -> tuple[str, str]:
    rng = style.rng
    parts = [rng.choice(pools.COMPANY_HEADS)]
    if rng.random() < 0.7:
        parts.append(rng.choice(pools.COMPANY_TRADES))
    parts.append(rng.choice(pools.COMPANY_FORMS))
    parts.append(rng.choice(pools.COMPANY_SUFFIXES))
    name = " ".join(parts)
    return name, name


def _nationality(style: Style) -> tuple[str, str]:
    code, name, demonym = style.rng.choice(pools.COUNTRIES)
    return style.pick([code, name, demonym, name.upper()]), code


def _id_number(style: Style) -> tuple[str, str]:
    rng = style.rng
    letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(rng.randint(1, 2)))
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(6, 8)))
    value = letters + digits
    return value, value


def _phone(style: Style) -> tuple[str, str]:
    rng = style.rng
    country = str(rng.choice([1, 7, 20, 33, 34, 41, 44, 49, 65, 81, 86, 91, 234, 254, 971]))
    groups = [
        "".join(rng.choice("0123456789") for _ in range(n))
        for n in rng.choice([(2, 4, 4), (3, 3, 4), (3, 4, 3), (2, 3, 4)])
    ]
    normalized = "+" + country + "".join(groups)
    formats = [
        normalized,
        f"+{country} {' '.join(groups)}",
        f"+{country}-{'-'.join(groups)}",
        f"+{country} {groups[0]} {''.join(groups[1:])}",
        f"(+{country}) {''.join(groups)}",
    ]
    return style.pick(formats), normalized


def _email(style: Style) -> tuple[str, str]:
    rng = style.rng
    local = f"{rng.choice(pools.FIRST_NAMES)}.{rng.choice(pools.LAST_NAMES)}".lower()
    value = f"{local}@{rng.choice(pools.EMAIL_DOMAINS)}"
    return value, value


def _verbatim(draw: Callable[[random.Random], str]) -> Callable[[Style], tuple[str, str]]:
    """A value that documents and JSON write the same way (a port, a bank, a reference)."""

    def render(style: Style) -> tuple[str, str]:
        value = draw(style.rng)
        return value, value

    return render


def _enum(style: Style, spellings: dict[str, list[str]]) -> tuple[str, str]:
    """`spellings` maps each normalized enum value to how documents write it (first: canonical)."""
    value = style.rng.choice(list(spellings))
    return style.pick(spellings[value]), value


def _group_thousands(whole: int, separator: str) -> str:
    return f"{whole:,}".replace(",", separator)


def _amount(style: Style, low: int, high: int, currency: tuple[str, str | None],
            with_code: bool = True) -> tuple[str, float | int]:
    """An amount as documents write it; `with_code=False` when the currency has its own line."""
    rng = style.rng
    whole = rng.randint(low, high)
    # Round figures dominate real credit documents; cents appear on a minority.
    whole = round(whole, -rng.choice([0, 2, 3])) if rng.random() < 0.6 else whole
    whole = max(whole, low)
    cents = rng.randint(1, 99) if rng.random() < 0.2 else 0
    value: float | int = round(whole + cents / 100, 2) if cents else whole
    code, symbol = currency
    plain = f"{whole}.{cents:02d}" if cents else str(whole)
    us = _group_thousands(whole, ",") + (f".{cents:02d}" if cents or rng.random() < 0.5 else "")
    eu = _group_thousands(whole, ".") + f",{cents:02d}"  # always with decimals: "1.250" alone is ambiguous
    if not with_code:
        return style.rng.choice([plain, us, eu]), value
    formats = [f"{code} {plain}", f"{code} {us}", f"{us} {code}", f"{code} {eu}"]
    if symbol:
        formats.append(f"{symbol}{us}")
    return style.pick(formats), value


# --- document kinds ---


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
        text, value = _amount(style, low, high, currency, with_code=not separate)
        values: dict[str, object] = {amount_key: value}
        if currency_key:
            values[currency_key] = currency[0]
        if separate:
            return text, values, [(style.pick(list(CURRENCY_LABELS)), currency[0])]
        return text, values

    return render


def _term_months(style: Style) -> tuple[str, int]:
    rng = style.rng
    years = rng.randint(1, 30)
    months = years * 12 if rng.random() < 0.6 else rng.randint(6, 360)
    formats = [f"{months} months", f"{months} mo.", f"{months}"]
    if months % 12 == 0:
        n = months // 12
        formats.append(f"{n} years" if n > 1 else "1 year")
    return style.pick(formats), months


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
                  _single("full_name", _person)),
        FieldSpec(("Date of birth", "DOB", "Birth date", "D.O.B.", "Born"),
                  _single("date_of_birth", lambda s: _date(s, 1940, 2005))),
        FieldSpec(("Nationality", "Citizenship", "Country of citizenship"),
                  _single("nationality", _nationality)),
        FieldSpec(("ID number", "Passport number", "Passport No.", "National ID", "Identity document no."),
                  _single("id_number", _id_number)),
        FieldSpec(("Phone", "Mobile", "Telephone", "Contact number", "Mobile phone"),
                  _single("phone", _phone)),
        FieldSpec(("Account type", "Product", "Type of account", "Account requested"),
                  _single("account_type", lambda s: _enum(s, {
                      "current": ["current", "Current account", "CURRENT", "Current"],
                      "savings": ["savings", "Savings account", "SAVINGS", "Savings"],
                      "business": ["business", "Business account", "BUSINESS", "Business current account"],
                      "joint": ["joint", "Joint account", "JOINT", "Joint current account"],
                  }))),
        FieldSpec(("Email", "E-mail", "Email address"), _single("email", _email), optional=True),
        FieldSpec(("Occupation", "Profession"),
                  _single("occupation", _verbatim(lambda r: r.choice([
                      "Engineer", "Teacher", "Accountant", "Nurse", "Lawyer", "Trader", "Farmer",
                      "Student", "Pharmacist", "Architect", "Software developer", "Civil servant"]))),
                  optional=True),
    ),
    distractors=(
        FieldSpec(("Application date", "Date of application", "Form date"),
                  _single("_", lambda s: _date(s, 2019, 2025))),
        FieldSpec(("Emergency contact phone", "Alternate phone", "Office phone"), _single("_", _phone)),
        FieldSpec(("Branch", "Home branch"), _single("_", _verbatim(lambda r: r.choice(pools.CITIES)))),
        FieldSpec(("Place of birth",), _single("_", _verbatim(lambda r: r.choice(pools.CITIES)))),
        FieldSpec(("Reference", "Form ref."), _single("_", _verbatim(lambda r: f"KYC-{r.randint(100000, 999999)}"))),
        FieldSpec(("Risk rating",), _single("_", _verbatim(lambda r: r.choice(["Low", "Medium", "High"])))),
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
                  _single("lc_number", _verbatim(lambda r: r.choice([
                      f"LC-{r.randint(2019, 2025)}-{r.randint(1000, 99999)}",
                      f"DC{r.randint(100000, 9999999)}",
                      f"ILC/{r.randint(19, 25)}/{r.randint(1000, 9999)}"])))),
        FieldSpec(("Date of issue", "Issue date", "Issued on", "Date of issuance"),
                  _single("issue_date", lambda s: _date(s, 2019, 2025))),
        FieldSpec(("Expiry date", "Date of expiry", "Expires", "Valid until"),
                  _single("expiry_date", lambda s: _date(s, 2020, 2027))),
        FieldSpec(("Applicant", "Buyer", "Ordering party", "By order of"), _single("applicant", _company)),
        FieldSpec(("Beneficiary", "Seller", "In favour of", "Beneficiary name"), _single("beneficiary", _company)),
        FieldSpec(("Amount", "Credit amount", "Value", "Sum of"),
                  _money("amount", "currency", 5_000, 5_000_000)),
        FieldSpec(("Issuing bank", "Issued by", "Opening bank"),
                  _single("issuing_bank", _verbatim(lambda r: r.choice(pools.BANKS))), optional=True),
        FieldSpec(("Port of loading", "Port of shipment", "Shipment from"),
                  _single("port_of_loading", _verbatim(lambda r: r.choice(pools.PORTS))), optional=True),
        FieldSpec(("Incoterms", "Delivery terms", "Trade terms"),
                  _single("incoterm", lambda s: _enum(s, {
                      code: [code, code.upper(), f"{code.upper()} (Incoterms 2020)"]
                      for code in ("fob", "cif", "cfr", "exw", "dap")
                  })), optional=True),
    ),
    distractors=(
        FieldSpec(("Latest shipment date", "Latest date of shipment"), _single("_", lambda s: _date(s, 2019, 2026))),
        FieldSpec(("Advising bank", "Confirming bank"), _single("_", _verbatim(lambda r: r.choice(pools.BANKS)))),
        FieldSpec(("Port of discharge", "Destination port"), _single("_", _verbatim(lambda r: r.choice(pools.PORTS)))),
        FieldSpec(("Partial shipments",), _single("_", _verbatim(lambda r: r.choice(["Allowed", "Not allowed"])))),
        FieldSpec(("Form of credit",),
                  _single("_", _verbatim(lambda r: r.choice(["Irrevocable", "Irrevocable, confirmed"])))),
        FieldSpec(("Tolerance",), _single("_", _verbatim(lambda r: f"+/- {r.choice([5, 10])}%"))),
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
        FieldSpec(("Applicant name", "Applicant", "Borrower", "Name of borrower"), _single("applicant_name", _person)),
        FieldSpec(("Loan amount", "Amount requested", "Requested amount", "Principal"),
                  _money("loan_amount", "currency", 1_000, 900_000)),
        FieldSpec(("Term", "Loan term", "Repayment period", "Tenor"), _single("term_months", _term_months)),
        FieldSpec(("Purpose", "Loan purpose", "Use of funds"),
                  _single("purpose", lambda s: _enum(s, {
                      "home": ["home", "Home purchase", "Mortgage / home", "HOME"],
                      "auto": ["auto", "Car purchase", "Vehicle (auto)", "AUTO"],
                      "business": ["business", "Business expansion", "Working capital (business)", "BUSINESS"],
                      "education": ["education", "Tuition fees", "Education", "EDUCATION"],
                      "personal": ["personal", "Personal use", "Other personal", "PERSONAL"],
                  }))),
        FieldSpec(("Annual income", "Gross annual income", "Yearly income", "Income (annual)"),
                  _money("annual_income", None, 8_000, 600_000)),
        FieldSpec(("Employment status", "Employment", "Work status"),
                  _single("employment_status", lambda s: _enum(s, {
                      "employed": ["employed", "Employed full-time", "Employed", "EMPLOYED"],
                      "self_employed": ["self_employed", "Self-employed", "Self employed", "SELF-EMPLOYED"],
                      "unemployed": ["unemployed", "Unemployed", "Not employed", "UNEMPLOYED"],
                      "retired": ["retired", "Retired", "Pensioner (retired)", "RETIRED"],
                  }))),
        FieldSpec(("Application date", "Date of application", "Date"),
                  _single("application_date", lambda s: _date(s, 2019, 2025)), optional=True),
        FieldSpec(("Co-applicant", "Joint applicant", "Co-borrower"), _single("co_applicant", _person), optional=True),
    ),
    distractors=(
        FieldSpec(("Monthly expenses", "Monthly outgoings"), _money("_", None, 200, 9_000)),
        FieldSpec(("Existing loans", "Outstanding debt"), _money("_", None, 0, 200_000)),
        FieldSpec(("Date of birth", "DOB"), _single("_", lambda s: _date(s, 1945, 2003))),
        FieldSpec(("Contact phone", "Phone"), _single("_", _phone)),
        FieldSpec(("Branch",), _single("_", _verbatim(lambda r: r.choice(pools.CITIES)))),
        FieldSpec(("Reference", "Application ref."),
                  _single("_", _verbatim(lambda r: f"LN-{r.randint(10000, 99999)}"))),
    ),
)

KIND_SPECS: dict[str, KindSpec] = {k.name: k for k in (KYC, LETTER_OF_CREDIT, LOAN_APPLICATION)}


def schema_for(kind: str) -> dict:
    """The JSON Schema of a document kind (every key present; optional ones nullable)."""
    return KIND_SPECS[kind].schema


# --- layout ---

_OCR_SWAPS = (("o", "0"), ("O", "0"), ("l", "1"), ("I", "l"), ("m", "rn"), ("e", "c"))


def _ocr_noise(label: str, rng: random.Random) -> str:
    """OCR-like damage, applied only to labels so that the ground truth stays recoverable."""
    candidates = [(a, b) for a, b in _OCR_SWAPS if a in label]
    if not candidates:
        return label
    a, b = rng.choice(candidates)
    at = rng.choice([i for i in range(len(label)) if label.startswith(a, i)])
    return label[:at] + b + label[at + len(a):]


def _label_text(label: str, style: Style, noise_rate: float) -> str:
    if style.varied() and style.rng.random() < 0.25:
        label = style.rng.choice([label.upper(), label.lower()])
    if style.varied() and style.rng.random() < noise_rate:
        label = _ocr_noise(label, style.rng)
    return label


def render_document(kind: str, rng: random.Random, variety: float = 1.0, noise_rate: float = 0.1) -> Document:
    """Draw one document of `kind`. noise_rate is the share of varied labels with OCR damage."""
    spec = KIND_SPECS[kind]
    style = Style(rng, variety)
    fields: dict[str, object] = {key: None for key in spec.schema["properties"]}
    lines: list[tuple[str, str]] = []
    for line in spec.lines:
        if line.optional and rng.random() < 0.35:
            continue
        text, values, *extra = line.render(style)
        fields.update(values)
        lines.append((style.pick(list(line.labels)), text))
        lines.extend(extra[0] if extra else [])  # e.g. a currency stated on its own line
    if style.varied():
        for distractor in rng.sample(spec.distractors, k=rng.randint(1, 3)):
            text, *_ = distractor.render(style)
            lines.insert(rng.randint(0, len(lines)), (style.pick(list(distractor.labels)), text))
    if style.varied():
        rng.shuffle(lines)
    separator = style.pick([": ", " : ", " - ", ":  "])
    body = [f"{_label_text(label, style, noise_rate)}{separator}{text}" for label, text in lines]
    header = [style.pick(list(spec.titles))]
    footer = [rng.choice(spec.footers)] if style.varied() and rng.random() < 0.3 else []
    return Document(kind=kind, text="\n".join(header + body + footer), fields=fields)


# --- splits ---


def _document_at(stream: str, index: int, variety: float = 1.0) -> Document:
    rng = random.Random(f"nowait:{stream}:{index}")
    kind = KINDS[index % len(KINDS)]
    document = render_document(kind, rng, variety=variety)
    return Document(kind=document.kind, text=document.text, fields=document.fields, doc_id=f"{stream}-{index}")


def _stream_name(split: str | None, seed: int | None) -> str:
    if seed is not None:
        return f"fresh{seed}"
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return split


def held_out_texts(n_each: int = 2000) -> frozenset[str]:
    """Texts of the first validation and test documents, which training must never see."""
    return frozenset(
        _document_at(split, i).text for split in ("validation", "test") for i in range(n_each)
    )


def documents(split: str | None = "test", n: int = 100, seed: int | None = None) -> list[Document]:
    """The first n documents of a split, or of a fresh sample `seed` (kinds in rotation).

    Validation and test are fixed lists; training draws from its own stream and skips any
    text that appears in them (see `training_stream`), so the splits never share a document.
    """
    stream = _stream_name(split, seed)
    return [_document_at(stream, i) for i in range(n)]


def training_range(start: int, stop: int, variety: Callable[[int], float] | float = 1.0,
                   exclude: frozenset[str] | None = None) -> list[Document]:
    """The training documents with data indices in [start, stop), held-out texts left out.

    A pure function of the range, so parallel batch builders can each take a range."""
    exclude = held_out_texts() if exclude is None else exclude
    found = (_document_at("train", index, variety=variety(index) if callable(variety) else variety)
             for index in range(start, stop))
    return [document for document in found if document.text not in exclude]


def training_stream(start: int = 0, variety: Callable[[int], float] | float = 1.0,
                    exclude: frozenset[str] | None = None) -> Iterator[Document]:
    """Endless training documents from index `start` on; `variety(i)` allows a curriculum."""
    exclude = held_out_texts() if exclude is None else exclude
    for chunk in count(start, 64):
        yield from training_range(chunk, chunk + 64, variety, exclude)
