"""Word lists for the templated prompts of build_prompts.py: forms, topics, tasks, concepts, names."""

WRITING_FORMS = [
    "a short poem", "a haiku", "a limerick", "a short story of about 150 words", "a fable with a moral",
    "a polite email to a colleague", "a cover letter paragraph", "a product description", "a blog post introduction",
    "a two-minute speech", "a letter to a friend", "a diary entry", "a tweet", "a news headline and lead paragraph",
    "a short dialogue between two characters", "a motivational message", "a restaurant review", "a travel guide entry",
    "a job advertisement", "an apology note", "a thank-you note", "a short essay outline", "a persuasive paragraph",
    "a children's bedtime story", "a riddle", "a song chorus", "a movie plot summary", "a museum label",
    "a social media post", "a short mystery scene", "a recipe introduction", "a weather report in the style of a poem",
]

WRITING_TOPICS = [
    "the ocean", "a rainy afternoon", "learning to code", "a lost cat", "the first day of school", "autumn leaves",
    "a robot who wants to be a chef", "friendship", "a mountain village", "the night sky", "a busy train station",
    "recycling", "a new smartphone", "a small bakery", "time travel", "a library at midnight", "moving to a new city",
    "a garden in spring", "a marathon", "the history of bicycles", "coffee", "a dragon afraid of fire",
    "an old lighthouse", "climate change", "a birthday party", "working from home", "a chess tournament",
    "the moon landing", "a quiet forest", "a lighthouse keeper", "a musician's first concert", "winter mornings",
    "a science fair", "a lost key", "the desert at night", "a family recipe", "electric cars", "a city park",
    "a snowstorm", "a detective and a missing painting", "volunteering", "a football match", "the internet",
    "a grandmother's advice", "a trip to the market", "honeybees", "a thunderstorm", "an abandoned castle",
    "a new hobby", "kindness", "a space station", "a street musician", "a school play", "a sunrise over the sea",
]

TONES = ["cheerful", "formal", "humorous", "serious", "friendly", "melancholic", "enthusiastic", "calm"]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "finds the largest element of a list", "removes duplicates from a list",
    "checks whether a string is a palindrome", "sorts a list of numbers with bubble sort",
    "merges two sorted lists into one sorted list", "computes the factorial of n", "converts Celsius to Fahrenheit",
    "counts how often each word appears in a text", "flattens a nested list", "returns the greatest common divisor",
    "checks whether two strings are anagrams", "finds the second largest number in a list",
    "computes the average of a list of numbers", "implements binary search", "transposes a matrix",
    "checks whether brackets in a string are balanced", "converts a decimal number to binary",
    "reads a CSV file and returns its rows", "returns the longest word in a sentence", "capitalizes every word",
    "computes the sum of the digits of an integer", "rotates a list by k positions", "checks for a leap year",
    "finds all divisors of a number", "implements a stack class", "implements a queue with two stacks",
    "computes the dot product of two vectors", "removes whitespace from both ends of every line in a file",
    "generates all permutations of a list", "returns the intersection of two lists", "validates an email address",
    "computes the median of a list", "counts the lines in a text file", "converts a Roman numeral to an integer",
    "converts an integer to a Roman numeral", "implements quicksort", "finds the missing number in 1..n",
    "chunks a list into pieces of size k", "computes compound interest", "parses a date string",
    "checks whether a list is sorted", "finds the mode of a list", "implements a simple linked list",
    "returns the n largest items of a list", "computes the power set of a set", "counts set bits in an integer",
    "implements a least-recently-used cache", "computes the edit distance between two strings",
    "finds the first non-repeating character in a string", "groups words by their first letter",
    "implements depth-first search on a graph", "implements breadth-first search on a graph",
    "computes the running total of a list", "checks whether a year, month and day form a valid date",
    "wraps text to a given width", "converts a dictionary to a JSON string and back", "zips two lists into a dict",
    "computes the area of a circle", "generates a random password", "returns the prime factors of a number",
    "merges overlapping intervals", "implements the sieve of Eratosthenes", "computes Pascal's triangle",
    "finds the longest common prefix of a list of strings", "counts the words in a file",
    "implements matrix multiplication", "finds pairs in a list that sum to a target",
]

LANGUAGES = ["Python", "Python", "Python", "Python", "JavaScript", "C", "Rust", "Go", "Java", "Bash", "C++", "Ruby"]

CODE_QUESTIONS = [
    "What is the difference between a list and a tuple in Python?", "How do Python decorators work?",
    "What is a generator in Python and when should I use one?", "Explain list comprehensions with examples.",
    "What is the difference between `==` and `is` in Python?", "How does exception handling work in Python?",
    "What are *args and **kwargs?", "Explain the difference between shallow and deep copies.",
    "What is a virtual environment and why use one?", "How do I read and write files in Python?",
    "What is recursion? Give an example.", "Explain Big-O notation with examples.",
    "What is the difference between a process and a thread?", "How does a hash table work?",
    "What is object-oriented programming?", "Explain the difference between git merge and git rebase.",
    "What is a REST API?", "How does garbage collection work in Python?", "What is a closure?",
    "What are type hints in Python and why are they useful?", "Explain how async and await work in Python.",
    "What is the difference between SQL JOIN types?", "How do I write unit tests in Python?",
    "What is a race condition and how can it be avoided?", "Explain what a lambda function is.",
    "What is the difference between a compiler and an interpreter?", "What does the `with` statement do?",
    "How do I handle command-line arguments in Python?", "What is memoization?", "Explain dynamic programming.",
]

CONCEPTS = [
    "photosynthesis", "the water cycle", "gravity", "inflation", "supply and demand", "the immune system",
    "plate tectonics", "black holes", "DNA", "natural selection", "the greenhouse effect", "electricity",
    "the French Revolution", "the Industrial Revolution", "democracy", "the Renaissance", "the Roman Empire",
    "the Cold War", "machine learning", "blockchain", "the theory of relativity", "quantum computing", "vaccines",
    "the periodic table", "the stock market", "compound interest", "climate change", "volcanoes", "earthquakes",
    "the solar system", "the human heart", "nutrition", "sleep", "the printing press", "the internet",
    "renewable energy", "nuclear power", "the scientific method", "probability", "algorithms", "encryption",
    "cloud computing", "the Great Wall of China", "ancient Egypt", "the Silk Road", "the Olympic Games",
    "the United Nations", "globalization", "opportunity cost", "the placebo effect", "antibiotics",
    "the speed of light", "magnetism", "the big bang", "evolution", "the nervous system", "tides",
    "the ozone layer", "rainbows", "the human eye", "batteries", "semiconductors", "neural networks",
    "operating systems", "databases", "the Pythagorean theorem", "prime numbers", "statistics", "the metric system",
    "photosynthesis versus respiration", "ecosystems", "biodiversity", "the carbon cycle", "weather forecasts",
]

COUNTRIES = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Mexico", "Norway", "Australia", "Germany",
    "Italy", "Spain", "Argentina", "China", "Peru", "Vietnam", "Morocco", "Greece", "Sweden", "Turkey", "Chile",
    "Nigeria", "Portugal", "Thailand", "Poland", "Ireland", "New Zealand", "South Korea", "Indonesia",
]

PEOPLE = [
    "Marie Curie", "Albert Einstein", "Ada Lovelace", "Isaac Newton", "Leonardo da Vinci", "Charles Darwin",
    "Nelson Mandela", "Mahatma Gandhi", "Galileo Galilei", "William Shakespeare", "Alan Turing", "Nikola Tesla",
    "Cleopatra", "Julius Caesar", "Wolfgang Amadeus Mozart", "Frida Kahlo", "Martin Luther King Jr.",
    "Rosalind Franklin", "Grace Hopper", "Confucius", "Aristotle", "Jane Austen", "Louis Pasteur", "Ibn Sina",
]

NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena", "Maya",
         "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]

ITEMS = ["apples", "books", "pencils", "marbles", "stickers", "cookies", "tickets", "stamps", "coins", "shells"]
