"""Values as documents write them: each renderer returns (the text in the document, the normalized value).

`Style` is the knob every random choice goes through: with probability `variety` a renderer
departs from the canonical spelling (another date format, an honorific, grouped digits).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from nowait.extraction import pools


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


def date(style: Style, start_year: int, end_year: int) -> tuple[str, str]:
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


def person(style: Style) -> tuple[str, str]:
    rng = style.rng
    name = f"{rng.choice(pools.FIRST_NAMES)} {rng.choice(pools.LAST_NAMES)}"
    if style.varied() and rng.random() < 0.5:
        return f"{rng.choice(pools.HONORIFICS)} {name}", name
    return name, name


def company(style: Style) -> tuple[str, str]:
    rng = style.rng
    parts = [rng.choice(pools.COMPANY_HEADS)]
    if rng.random() < 0.7:
        parts.append(rng.choice(pools.COMPANY_TRADES))
    parts.append(rng.choice(pools.COMPANY_FORMS))
    parts.append(rng.choice(pools.COMPANY_SUFFIXES))
    name = " ".join(parts)
    return name, name


def nationality(style: Style) -> tuple[str, str]:
    code, name, demonym = style.rng.choice(pools.COUNTRIES)
    return style.pick([code, name, demonym, name.upper()]), code


def id_number(style: Style) -> tuple[str, str]:
    rng = style.rng
    letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(rng.randint(1, 2)))
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(6, 8)))
    value = letters + digits
    return value, value


def phone(style: Style) -> tuple[str, str]:
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


def email(style: Style) -> tuple[str, str]:
    rng = style.rng
    local = f"{rng.choice(pools.FIRST_NAMES)}.{rng.choice(pools.LAST_NAMES)}".lower()
    value = f"{local}@{rng.choice(pools.EMAIL_DOMAINS)}"
    return value, value


def verbatim(draw: Callable[[random.Random], str]) -> Callable[[Style], tuple[str, str]]:
    """A value that documents and JSON write the same way (a port, a bank, a reference)."""

    def render(style: Style) -> tuple[str, str]:
        value = draw(style.rng)
        return value, value

    return render


def enum(style: Style, spellings: dict[str, list[str]]) -> tuple[str, str]:
    """`spellings` maps each normalized enum value to how documents write it (first: canonical)."""
    value = style.rng.choice(list(spellings))
    return style.pick(spellings[value]), value


def _group_thousands(whole: int, separator: str) -> str:
    return f"{whole:,}".replace(",", separator)


def amount(style: Style, low: int, high: int, currency: tuple[str, str | None],
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



def term_months(style: Style) -> tuple[str, int]:
    rng = style.rng
    years = rng.randint(1, 30)
    months = years * 12 if rng.random() < 0.6 else rng.randint(6, 360)
    formats = [f"{months} months", f"{months} mo.", f"{months}"]
    if months % 12 == 0:
        n = months // 12
        formats.append(f"{n} years" if n > 1 else "1 year")
    return style.pick(formats), months
