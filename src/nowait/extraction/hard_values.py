"""Values as the hard tier writes them: more date and amount formats, amounts in words, names
with other honorifics and three parts, phone numbers with a 00 prefix. Each renderer returns
(text, normalized value) like `nowait.extraction.values`, whose clean formats it also draws.
"""

from __future__ import annotations

import random

from nowait.extraction import pools
from nowait.extraction.values import Style, amount, date, phone

HONORIFICS = ("Mdm", "Mdm.", "Mr.", "Mrs", "Ms.", "Dr.", "Sir", "Mx", "Prof.", "Miss")
# Three-part names as many Asian forms write them (family name first), beside the pools' names.
FAMILY_FIRST = ("Lee", "Tan", "Lim", "Ng", "Wong", "Chua", "Goh", "Nguyen", "Tran", "Park", "Kim", "Choi")
GIVEN_PARTS = ("Hui", "Min", "Wei", "Ling", "Jun", "Mei", "Xin", "Hoa", "Anh", "Seo", "Yeon", "Kai")
CURRENCY_WORDS = {"USD": "US Dollars", "EUR": "Euros", "GBP": "Pounds Sterling", "CHF": "Swiss Francs",
                  "JPY": "Japanese Yen", "SGD": "Singapore Dollars", "AED": "UAE Dirhams",
                  "CNY": "Chinese Yuan", "INR": "Indian Rupees", "CAD": "Canadian Dollars"}
_ONES = ("", "One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten", "Eleven", "Twelve",
         "Thirteen", "Fourteen", "Fifteen", "Sixteen", "Seventeen", "Eighteen", "Nineteen")
_TENS = ("", "", "Twenty", "Thirty", "Forty", "Fifty", "Sixty", "Seventy", "Eighty", "Ninety")


def number_words(n: int) -> str:
    """An integer in English words, as cheques and credits write it ("Two Hundred Fifty Thousand")."""
    if n == 0:
        return "Zero"
    parts = []
    for scale, name in ((1_000_000_000, "Billion"), (1_000_000, "Million"), (1_000, "Thousand"), (1, "")):
        chunk, n = divmod(n, scale)
        if not chunk:
            continue
        hundreds, rest = divmod(chunk, 100)
        words = [f"{_ONES[hundreds]} Hundred"] if hundreds else []
        if rest:
            words.append(_ONES[rest] if rest < 20 else "-".join(w for w in (_TENS[rest // 10], _ONES[rest % 10]) if w))
        parts.append(" ".join(words + ([name] if name else [])))
    return " ".join(parts)


def _ordinal(day: int) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def hard_date(rng: random.Random, start_year: int, end_year: int) -> tuple[str, str]:
    """A date in one of the clean formats or in forms the clean tier never writes (day first)."""
    text, iso = date(Style(rng, 1.0), start_year, end_year)
    year, month, day = (int(p) for p in iso.split("-"))
    name = pools.MONTHS[month - 1]
    extra = [f"{_ordinal(day)} {name} {year}", f"{name} {_ordinal(day)}, {year}", f"{day}/{month}/{year}",
             f"{day:02d}-{month:02d}-{year}", f"{year}.{month:02d}.{day:02d}", f"{day} {name[:3]}. {year}",
             f"{day:02d} {name.upper()} {year}", f"{year}{month:02d}{day:02d}"]
    return (rng.choice(extra) if rng.random() < 0.6 else text), iso


def hard_person(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.3:
        name = f"{rng.choice(FAMILY_FIRST)} {rng.choice(GIVEN_PARTS)} {rng.choice(GIVEN_PARTS)}"
    else:
        name = f"{rng.choice(pools.FIRST_NAMES)} {rng.choice(pools.LAST_NAMES)}"
    return (f"{rng.choice(HONORIFICS)} {name}" if rng.random() < 0.5 else name), name


def hard_phone(rng: random.Random) -> tuple[str, str]:
    text, normalized = phone(Style(rng, 1.0))
    digits = normalized[1:]
    extra = [f"00{digits}", f"00 {text.lstrip('+(').replace(')', '')}", text.replace(" ", ".").replace("-", ".")]
    return (rng.choice(extra) if rng.random() < 0.4 else text), normalized


def _grouped(whole: int, rng: random.Random, code: str) -> str:
    style = rng.choice(["space", "apostrophe", "comma"] + (["lakh"] if code == "INR" else []))
    if style == "lakh" and whole >= 100_000:
        head, tail = divmod(whole, 1000)
        return _lakh(head) + f",{tail:03d}"
    sep = {"space": " ", "apostrophe": "'", "comma": ","}.get(style, ",")
    return f"{whole:,}".replace(",", sep)


def _lakh(n: int) -> str:
    """Indian grouping of the part above the thousands: 12,50 (as in 12,50,000)."""
    digits = str(n)
    groups = []
    while len(digits) > 2:
        groups.insert(0, digits[-2:])
        digits = digits[:-2]
    return ",".join(([digits] if digits else []) + groups)


def hard_amount(rng: random.Random, low: int, high: int, currency: tuple[str, str | None],
                with_code: bool = True) -> tuple[str, float | int]:
    """An amount with other digit grouping, or in words beside (rarely instead of) the figure."""
    text, value = amount(Style(rng, 1.0), low, high, currency, with_code)
    code = currency[0]
    whole, cents = int(value), round((value - int(value)) * 100)
    roll = rng.random()
    if roll < 0.3:
        figure = _grouped(whole, rng, code) + (f".{cents:02d}" if cents else rng.choice(["", ".00"]))
        return (f"{code} {figure}" if with_code else figure), value
    if roll < 0.5 and with_code and not cents:
        return f"{text} ({CURRENCY_WORDS[code]} {number_words(whole)} only)", value
    if roll < 0.58 and with_code and not cents and whole % 1000 == 0:
        return f"{CURRENCY_WORDS[code]} {number_words(whole)}", value
    return text, value


def hard_term(rng: random.Random) -> tuple[str, int]:
    years = rng.randint(1, 30)
    months = years * 12 if rng.random() < 0.6 else rng.randint(6, 360)
    formats = [f"{months} months", f"{months}-month", f"{months} mths", f"{months} monthly instalments"]
    if months % 12 == 0:
        n = months // 12
        formats += [f"{n} yrs" if n > 1 else "1 yr",
                    f"{number_words(n).lower()} ({n}) years" if n > 1 else "one (1) year"]
    return rng.choice(formats), months
