"""speculation/verify"""
