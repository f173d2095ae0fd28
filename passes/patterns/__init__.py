"""Recognizers: each turns a graph fragment into a small typed record, or raises NoMatch saying why."""
