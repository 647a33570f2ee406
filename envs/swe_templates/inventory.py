"""Template `inventory`: a stock class and priced orders fulfilled from it (package `shop`)."""

from __future__ import annotations

from envs.swe_templates import Mutation, Template, source

INIT = source('''
"""shop: stock levels per SKU and orders served from them."""

from shop.inventory import Inventory, OutOfStock
from shop.orders import Order, OrderLine, fulfil

__all__ = ["Inventory", "Order", "OrderLine", "OutOfStock", "fulfil"]
''')

INVENTORY = source('''
"""Stock levels per SKU (stock-keeping unit)."""

from __future__ import annotations


class OutOfStock(Exception):
    """More units were requested than are in stock."""


class Inventory:
    """Units in stock per SKU. A SKU whose stock falls to zero is forgotten."""

    def __init__(self) -> None:
        self._stock: dict[str, int] = {}

    def add(self, sku: str, quantity: int) -> None:
        """Put `quantity` (a positive number of) units of `sku` in stock."""
        if quantity <= 0:
            raise ValueError(f"quantity must be positive, got {quantity}")
        self._stock[sku] = self._stock.get(sku, 0) + quantity

    def remove(self, sku: str, quantity: int) -> None:
        """Take `quantity` units out of stock. OutOfStock, and nothing removed, when fewer are there."""
        if quantity <= 0:
            raise ValueError(f"quantity to remove must be positive, got {quantity}")
        available = self._stock.get(sku, 0)
        if available < quantity:
            raise OutOfStock(f"{sku}: {quantity} requested, {available} in stock")
        remaining = available - quantity
        if remaining == 0:
            del self._stock[sku]
        else:
            self._stock[sku] = remaining

    def quantity(self, sku: str) -> int:
        """Units of `sku` in stock (0 for an unknown SKU)."""
        return self._stock.get(sku, 0)

    def skus(self) -> list[str]:
        """The SKUs in stock, sorted."""
        return sorted(self._stock)

    def total_units(self) -> int:
        return sum(self._stock.values())

    def low_stock(self, threshold: int = 5) -> list[str]:
        """The SKUs with fewer than `threshold` units in stock, sorted."""
        return sorted(sku for sku, units in self._stock.items() if units < threshold)
''')

ORDERS = source('''
"""Orders: priced lines, a percentage discount, tax, and fulfilment from an Inventory."""

from __future__ import annotations

from dataclasses import dataclass, field

from shop.inventory import Inventory, OutOfStock


@dataclass(frozen=True)
class OrderLine:
    sku: str
    quantity: int
    unit_price: float

    @property
    def amount(self) -> float:
        return self.quantity * self.unit_price


@dataclass
class Order:
    lines: list[OrderLine] = field(default_factory=list)
    discount_percent: float = 0.0

    def add_line(self, sku: str, quantity: int, unit_price: float) -> None:
        if quantity <= 0 or unit_price < 0:
            raise ValueError(f"bad line for {sku}: quantity {quantity}, unit price {unit_price}")
        self.lines.append(OrderLine(sku, quantity, unit_price))

    def subtotal(self) -> float:
        """The sum of the lines' amounts."""
        return sum(line.amount for line in self.lines)

    def discount(self) -> float:
        """The amount taken off the subtotal: `discount_percent` percent of it."""
        return self.subtotal() * self.discount_percent / 100

    def total(self, tax_rate: float = 0.2) -> float:
        """The subtotal less the discount, plus tax at `tax_rate`, rounded to cents."""
        net = self.subtotal() - self.discount()
        return round(net * (1 + tax_rate), 2)


def fulfil(order: Order, inventory: Inventory) -> None:
    """Take every line's units out of `inventory`, all or nothing: when any SKU lacks units,
    OutOfStock is raised and the inventory is left unchanged. Lines of the same SKU add up."""
    needed: dict[str, int] = {}
    for line in order.lines:
        needed[line.sku] = needed.get(line.sku, 0) + line.quantity
    for sku, quantity in needed.items():
        if inventory.quantity(sku) < quantity:
            raise OutOfStock(f"{sku}: {quantity} needed, {inventory.quantity(sku)} in stock")
    for sku, quantity in needed.items():
        inventory.remove(sku, quantity)
''')

TEST_INVENTORY = source("""
import unittest

from shop.inventory import Inventory, OutOfStock


def stocked(**units):
    inventory = Inventory()
    for sku, quantity in units.items():
        inventory.add(sku, quantity)
    return inventory


class TestAdd(unittest.TestCase):
    def test_add_accumulates(self):
        inventory = stocked(apple=3)
        inventory.add("apple", 4)
        self.assertEqual(inventory.quantity("apple"), 7)

    def test_zero_raises(self):
        with self.assertRaises(ValueError):
            Inventory().add("apple", 0)

    def test_negative_raises(self):
        with self.assertRaises(ValueError):
            Inventory().add("apple", -2)


class TestRemove(unittest.TestCase):
    def test_remove_some(self):
        inventory = stocked(pear=5)
        inventory.remove("pear", 2)
        self.assertEqual(inventory.quantity("pear"), 3)

    def test_remove_everything_forgets_sku(self):
        inventory = stocked(pear=5, fig=1)
        inventory.remove("pear", 5)
        self.assertEqual(inventory.quantity("pear"), 0)
        self.assertEqual(inventory.skus(), ["fig"])

    def test_remove_too_many_raises_and_keeps_stock(self):
        inventory = stocked(pear=2)
        with self.assertRaises(OutOfStock):
            inventory.remove("pear", 3)
        self.assertEqual(inventory.quantity("pear"), 2)

    def test_unknown_sku_raises(self):
        with self.assertRaises(OutOfStock):
            Inventory().remove("kiwi", 1)


class TestQueries(unittest.TestCase):
    def test_skus_sorted(self):
        self.assertEqual(stocked(plum=1, apple=2).skus(), ["apple", "plum"])

    def test_total_units(self):
        self.assertEqual(stocked(plum=1, apple=2).total_units(), 3)

    def test_low_stock_default_threshold(self):
        inventory = stocked(apple=2, pear=4, plum=5, fig=9)
        self.assertEqual(inventory.low_stock(), ["apple", "pear"])

    def test_low_stock_custom_threshold(self):
        inventory = stocked(apple=2, pear=4, plum=5)
        self.assertEqual(inventory.low_stock(threshold=3), ["apple"])


if __name__ == "__main__":
    unittest.main()
""")

TEST_ORDERS = source("""
import unittest

from shop.inventory import Inventory, OutOfStock
from shop.orders import Order, fulfil


def order_of(*lines, discount=0.0):
    order = Order(discount_percent=discount)
    for sku, quantity, price in lines:
        order.add_line(sku, quantity, price)
    return order


class TestPricing(unittest.TestCase):
    def test_subtotal(self):
        self.assertEqual(order_of(("a", 2, 1.5), ("b", 1, 4.0)).subtotal(), 7.0)

    def test_discount(self):
        self.assertAlmostEqual(order_of(("a", 4, 25.0), discount=10).discount(), 10.0)

    def test_total_default_tax(self):
        self.assertEqual(order_of(("a", 1, 10.0)).total(), 12.0)

    def test_total_with_discount_and_tax(self):
        self.assertEqual(order_of(("a", 2, 50.0), discount=10).total(tax_rate=0.1), 99.0)

    def test_total_rounded_to_cents(self):
        self.assertEqual(order_of(("a", 3, 3.33)).total(tax_rate=0.07), 10.69)

    def test_bad_line_raises(self):
        with self.assertRaises(ValueError):
            order_of(("a", 0, 1.0))


class TestFulfil(unittest.TestCase):
    def test_takes_units(self):
        inventory = Inventory()
        inventory.add("a", 5)
        fulfil(order_of(("a", 2, 1.0)), inventory)
        self.assertEqual(inventory.quantity("a"), 3)

    def test_lines_of_same_sku_add_up(self):
        inventory = Inventory()
        inventory.add("a", 3)
        with self.assertRaises(OutOfStock):
            fulfil(order_of(("a", 2, 1.0), ("a", 2, 1.0)), inventory)
        self.assertEqual(inventory.quantity("a"), 3)

    def test_all_or_nothing(self):
        inventory = Inventory()
        inventory.add("a", 5)
        inventory.add("b", 1)
        with self.assertRaises(OutOfStock):
            fulfil(order_of(("a", 2, 1.0), ("b", 2, 1.0)), inventory)
        self.assertEqual((inventory.quantity("a"), inventory.quantity("b")), (5, 1))


if __name__ == "__main__":
    unittest.main()
""")

MUTATIONS = (
    Mutation(
        "add-zero",
        "shop/inventory.py",
        'if quantity <= 0:\n            raise ValueError(f"quantity must be positive',
        'if quantity < 0:\n            raise ValueError(f"quantity must be positive',
        "Inventory.add() must refuse a quantity of 0 with ValueError.",
        ("tests.test_inventory.TestAdd.test_zero_raises",),
    ),
    Mutation(
        "remove-all",
        "shop/inventory.py",
        "if available < quantity:",
        "if available <= quantity:",
        "Inventory.remove() must allow taking out every unit in stock.",
        ("tests.test_inventory.TestRemove.test_remove_everything_forgets_sku",),
    ),
    Mutation(
        "remove-forget",
        "shop/inventory.py",
        "if remaining == 0:",
        "if remaining < 0:",
        "Inventory.remove() must forget a SKU whose stock falls to zero (it is no longer listed by skus()).",
        ("tests.test_inventory.TestRemove.test_remove_everything_forgets_sku",),
    ),
    Mutation(
        "low-stock-default",
        "shop/inventory.py",
        "def low_stock(self, threshold: int = 5)",
        "def low_stock(self, threshold: int = 3)",
        "Inventory.low_stock() must list the SKUs with fewer than 5 units by default.",
        ("tests.test_inventory.TestQueries.test_low_stock_default_threshold",),
    ),
    Mutation(
        "discount-percent",
        "shop/orders.py",
        "return self.subtotal() * self.discount_percent / 100",
        "return self.subtotal() * self.discount_percent / 10",
        "Order.discount() must take discount_percent percent of the subtotal.",
        (
            "tests.test_orders.TestPricing.test_discount",
            "tests.test_orders.TestPricing.test_total_with_discount_and_tax",
        ),
    ),
    Mutation(
        "total-cents",
        "shop/orders.py",
        "return round(net * (1 + tax_rate), 2)",
        "return round(net * (1 + tax_rate))",
        "Order.total() must round to cents, not to whole units.",
        ("tests.test_orders.TestPricing.test_total_rounded_to_cents",),
    ),
    Mutation(
        "fulfil-same-sku",
        "shop/orders.py",
        "needed[line.sku] = needed.get(line.sku, 0) + line.quantity",
        "needed[line.sku] = line.quantity",
        "fulfil() must add up the quantities of several lines of the same SKU.",
        ("tests.test_orders.TestFulfil.test_lines_of_same_sku_add_up",),
    ),
)

TEMPLATE = Template(
    "inventory",
    "shop",
    {
        "shop/__init__.py": INIT,
        "shop/inventory.py": INVENTORY,
        "shop/orders.py": ORDERS,
        "tests/test_inventory.py": TEST_INVENTORY,
        "tests/test_orders.py": TEST_ORDERS,
    },
    MUTATIONS,
)
