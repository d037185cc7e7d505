"""Value pools the synthetic documents draw from: names, countries, companies, banks, ports.

Kept as plain data so the generator stays readable. All names are invented combinations of
common given names and surnames; companies are built from parts at generation time.
"""

FIRST_NAMES = [
    "Maria", "James", "Aisha", "Wei", "Olga", "Carlos", "Fatima", "Hiroshi", "Ingrid", "Kwame",
    "Priya", "Lucas", "Amara", "Dmitri", "Sofia", "Mateo", "Yuki", "Elena", "Omar", "Chloe",
    "Rahul", "Anna", "Tomasz", "Leila", "Samuel", "Mei", "Jonas", "Nadia", "Pedro", "Zara",
    "Emeka", "Clara", "Arjun", "Hannah", "Ivan", "Lina", "Diego", "Grace", "Kenji", "Ruth",
    "Felix", "Noor", "Marco", "Astrid", "Tunde", "Julia", "Ravi", "Eva", "Hassan", "Lucia",
    "Oscar", "Sara", "Bruno", "Ayumi", "Victor", "Helen", "Ali", "Marta", "Daniel", "Ines",
]

LAST_NAMES = [
    "Okafor", "Smith", "Khan", "Zhang", "Petrova", "Garcia", "Haddad", "Tanaka", "Larsen", "Mensah",
    "Sharma", "Silva", "Diallo", "Ivanov", "Rossi", "Fernandez", "Sato", "Popescu", "Farouk", "Martin",
    "Gupta", "Schmidt", "Nowak", "Rahimi", "Adeyemi", "Chen", "Berg", "Aziz", "Costa", "Malik",
    "Eze", "Dubois", "Patel", "Weber", "Kuznetsov", "Nasser", "Lopez", "Owusu", "Kimura", "Cohen",
    "Fischer", "Hussain", "Bianchi", "Nilsson", "Bello", "Novak", "Reddy", "Horvat", "Mahmoud",
    "Moreno", "Jensen", "Santos", "Wagner", "Yamada", "Kowalski", "Murphy", "Ahmed", "Ortiz",
    "Lindqvist", "Almeida",
]

HONORIFICS = ["Mr.", "Mrs.", "Ms.", "Dr.", "Mr", "Mrs", "Ms", "Dr", "Prof."]

# (ISO 3166-1 alpha-2, country name, demonym)
COUNTRIES = [
    ("GB", "United Kingdom", "British"),
    ("US", "United States", "American"),
    ("DE", "Germany", "German"),
    ("FR", "France", "French"),
    ("IT", "Italy", "Italian"),
    ("ES", "Spain", "Spanish"),
    ("NL", "Netherlands", "Dutch"),
    ("CH", "Switzerland", "Swiss"),
    ("SE", "Sweden", "Swedish"),
    ("NO", "Norway", "Norwegian"),
    ("PL", "Poland", "Polish"),
    ("PT", "Portugal", "Portuguese"),
    ("IE", "Ireland", "Irish"),
    ("NG", "Nigeria", "Nigerian"),
    ("GH", "Ghana", "Ghanaian"),
    ("KE", "Kenya", "Kenyan"),
    ("ZA", "South Africa", "South African"),
    ("EG", "Egypt", "Egyptian"),
    ("IN", "India", "Indian"),
    ("PK", "Pakistan", "Pakistani"),
    ("CN", "China", "Chinese"),
    ("JP", "Japan", "Japanese"),
    ("SG", "Singapore", "Singaporean"),
    ("AE", "United Arab Emirates", "Emirati"),
    ("BR", "Brazil", "Brazilian"),
    ("MX", "Mexico", "Mexican"),
    ("CA", "Canada", "Canadian"),
    ("AU", "Australia", "Australian"),
    ("TR", "Turkey", "Turkish"),
    ("RO", "Romania", "Romanian"),
]

MONTHS = [
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
]

# (ISO 4217 code, symbol or None)
CURRENCIES = [
    ("USD", "$"), ("EUR", "€"), ("GBP", "£"), ("CHF", None), ("JPY", "¥"),
    ("SGD", None), ("AED", None), ("CNY", None), ("INR", None), ("CAD", None),
]

COMPANY_HEADS = [
    "Northwind", "Atlas", "Meridian", "Harbor", "Sterling", "Orion", "Cedar", "Falcon", "Summit",
    "Pioneer", "Lotus", "Baltic", "Sahara", "Everest", "Coral", "Granite", "Hanseatic", "Silk Road",
    "Blue River", "Golden Gate", "Aurora", "Delta", "Kestrel", "Monarch", "Zenith", "Oakridge",
]
COMPANY_TRADES = [
    "Textile", "Steel", "Agro", "Electronics", "Shipping", "Pharma", "Timber", "Coffee", "Cotton",
    "Machinery", "Chemicals", "Foods", "Logistics", "Minerals", "Solar", "Marine", "Paper", "Rice",
]
COMPANY_FORMS = [
    "Trading", "Traders", "Industries", "Exports", "Imports", "Holdings", "Supplies", "Group",
]
COMPANY_SUFFIXES = ["Ltd", "GmbH", "LLC", "PLC", "S.A.", "Pte Ltd", "Inc.", "B.V.", "AG", "Co."]

BANKS = [
    "First Meridian Bank", "Atlas Commercial Bank", "Harbor Trust Bank", "Sterling Union Bank",
    "Crown Merchant Bank", "Pacific Rim Bank", "Nordic Trade Bank", "Alpine Cantonal Bank",
    "Gulf Investment Bank", "Lagos Commerce Bank", "Eastern Exchange Bank", "Continental Bank",
]

PORTS = [
    "Rotterdam", "Hamburg", "Antwerp", "Felixstowe", "Singapore", "Shanghai", "Shenzhen", "Busan",
    "Jebel Ali", "Mombasa", "Lagos", "Durban", "Santos", "Valencia", "Genoa", "Le Havre",
    "Mumbai", "Karachi", "Yokohama", "Vancouver", "Houston", "Gdansk",
]

CITIES = [
    "London", "Berlin", "Paris", "Madrid", "Zurich", "Lagos", "Nairobi", "Mumbai", "Dubai",
    "Singapore", "Toronto", "Sydney", "Warsaw", "Lisbon", "Oslo", "Accra", "Cairo", "Tokyo",
]

EMAIL_DOMAINS = ["example.com", "mail.example.org", "post.example.net", "inbox.example.com"]
