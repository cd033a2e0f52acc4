// Command wordcount prints how many times each word occurs on standard input.
package main

import (
	"bufio"
	"fmt"
	"os"
	"sort"
	"strings"
)

func main() {
	counts := map[string]int{}
	scanner := bufio.NewScanner(os.Stdin)
	for scanner.Scan() {
		for _, word := range strings.Fields(scanner.Text()) {
			counts[strings.ToLower(word)]++
		}
	}
	words := make([]string, 0, len(counts))
	for w := range counts {
		words = append(words, w)
	}
	sort.Strings(words)
	for _, w := range words {
		fmt.Printf("%6d %s\n", counts[w], w)
	}
}
